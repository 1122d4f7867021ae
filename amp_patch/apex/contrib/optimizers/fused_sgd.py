"""``apex.contrib.optimizers.fused_sgd``: ``FusedSGD``, the SGD of ``apex.optimizers``."""
from ...optimizers import FusedSGD

__all__ = ["FusedSGD"]
