"""``apex.optimizers.fused_sgd``: Apex's module of ``FusedSGD``, which scripts import
by its path (``import apex.optimizers.fused_sgd as m``)."""
from . import FusedSGD

__all__ = ["FusedSGD"]
