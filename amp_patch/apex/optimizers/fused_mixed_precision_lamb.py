"""``apex.optimizers.fused_mixed_precision_lamb``: Apex's module of ``FusedMixedPrecisionLamb``, which scripts import
by its path (``import apex.optimizers.fused_mixed_precision_lamb as m``)."""
from . import FusedMixedPrecisionLamb

__all__ = ["FusedMixedPrecisionLamb"]
