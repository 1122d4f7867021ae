"""Helpers shared by several test modules (imported as a sibling module, as
``op_samples`` is)."""
from __future__ import annotations

import contextlib
import shutil
import sysconfig
import textwrap
import time

import pytest

import amp_patch
from amp_patch.frontends import launcher
from amp_patch.patching import wrappers

#: every environment variable amp_patch reads
ENV = (launcher.ENV_OPT_LEVEL, launcher.ENV_HALF_DTYPE, launcher.ENV_LOSS_SCALE, launcher.ENV_LISTS, launcher.ENV_OUTPUTS)

#: a C compiler is here, so every install must build the C fast path
HAS_C_COMPILER = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is not None


def fast_path():
    """The C fast path's module; fails the test when it is not built."""
    if wrappers.fast is None:
        pytest.fail(f"the C fast path is not built: {wrappers.FAST_UNAVAILABLE}")
    return wrappers.fast


@contextlib.contextmanager
def amp(*args, **kwargs):
    """``initialize`` (quiet unless ``verbosity`` is given), always ``deinitialize``."""
    kwargs.setdefault("verbosity", 0)
    out = amp_patch.initialize(*args, **kwargs)
    try:
        yield out
    finally:
        amp_patch.deinitialize()


def destroy_process_group():
    """``dist.destroy_process_group()``, after letting gloo finish the last collective.

    gloo's worker thread frees a finished collective's tensors with the GIL;
    if the process group is destroyed (when the last DDP model holding it is
    freed) by a thread that holds the GIL meanwhile, torch deadlocks. Sleeping
    releases the GIL long enough for that thread to finish.
    """
    import torch.distributed as dist

    time.sleep(0.05)
    dist.destroy_process_group()


def write(tmp_path, name, body):
    """Write the dedented ``body`` to ``tmp_path / name``; return the path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path
