"""Stand-in for Apex's ``python -m apex.parallel.multiproc`` launcher.

Apex's launcher started one process per GPU and passed each ``--rank`` and
``--world-size``. It is not provided: run as a module, this one prints the
``torchrun`` command that replaces it and exits with status 2.
"""
from __future__ import annotations

import shlex
import sys
from typing import List, Optional

import torch

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Print the ``torchrun`` command for ``argv`` (the script and its
    arguments, as given to Apex's launcher) to stderr; return 2.

    Args:
        argv: the launcher's arguments; ``sys.argv[1:]`` when None.

    Example::

        $ python -m apex.parallel.multiproc main.py --world-size 4 -b 64
        apex.parallel.multiproc is not provided; launch with:
            torchrun --nproc_per_node=4 main.py -b 64
        ...
    """
    args = list(sys.argv[1:] if argv is None else argv)
    nproc = str(torch.cuda.device_count() or 1)
    script_args = []
    it = iter(args)
    for arg in it:
        if arg in ("--rank", "--world-size"):
            value = next(it, nproc)
            if arg == "--world-size":
                nproc = value
        else:
            script_args.append(arg)
    sys.stderr.write(
        "apex.parallel.multiproc is not provided; launch with:\n"
        f"    torchrun --nproc_per_node={nproc} {shlex.join(script_args)}\n"
        "torchrun gives each process RANK, LOCAL_RANK and WORLD_SIZE in its environment instead of "
        "--rank and --world-size arguments: read those (or call torch.distributed.init_process_group() "
        "with its default env:// and then get_rank() and get_world_size()).\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
