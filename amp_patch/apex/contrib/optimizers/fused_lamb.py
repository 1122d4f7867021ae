"""``apex.contrib.optimizers.fused_lamb``: ``FusedLAMB``, the LAMB of ``apex.optimizers``."""
from ...optimizers import FusedLAMB

__all__ = ["FusedLAMB"]
