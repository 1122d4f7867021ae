"""``apex.optimizers.fused_adagrad``: Apex's module of ``FusedAdagrad``, which scripts import
by its path (``import apex.optimizers.fused_adagrad as m``)."""
from . import FusedAdagrad

__all__ = ["FusedAdagrad"]
