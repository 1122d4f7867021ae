"""``apex.parallel.optimized_sync_batchnorm``: Apex's CUDA ``SyncBatchNorm``,
the same module as ``apex.parallel.SyncBatchNorm`` here."""
from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
