"""``apex.optimizers.fused_adam``: Apex's module of ``FusedAdam``, which scripts import
by its path (``import apex.optimizers.fused_adam as m``)."""
from . import FusedAdam

__all__ = ["FusedAdam"]
