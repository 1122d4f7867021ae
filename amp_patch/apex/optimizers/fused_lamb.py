"""``apex.optimizers.fused_lamb``: Apex's module of ``FusedLAMB``, which scripts import
by its path (``import apex.optimizers.fused_lamb as m``)."""
from . import FusedLAMB

__all__ = ["FusedLAMB"]
