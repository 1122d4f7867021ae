"""Stand-in for Apex's ``apex.parallel``, which current Apex no longer ships.

The same names as Apex's package, computed with torch: ``DistributedDataParallel``
on ``torch.nn.parallel.DistributedDataParallel``, ``SyncBatchNorm`` on
``torch.distributed.all_reduce`` (on CPU under gloo too), and the ``LARC``
module holding the ``LARC`` optimizer wrapper, so both
``from apex.parallel.LARC import LARC`` and ``from apex.parallel import LARC``
(then ``LARC.LARC(...)``) work as they did. ``python -m
apex.parallel.multiproc`` says to launch with ``torchrun`` instead.
"""
from __future__ import annotations

import torch.distributed

from .._submodules import submodule_getattr
from . import LARC
from .distributed import DistributedDataParallel, Reducer
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

#: Apex re-exported torch's reduction ops under this name.
ReduceOp = torch.distributed.ReduceOp

__all__ = ["DistributedDataParallel", "LARC", "ReduceOp", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group"]

__getattr__ = submodule_getattr(__name__)  # the submodules not imported above, on first use
