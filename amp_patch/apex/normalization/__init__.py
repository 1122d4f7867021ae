"""Stand-in for ``apex.normalization``: Apex's fused layer and RMS norms.

As in Apex, the package holds the four norm modules and ``fused_layer_norm``
is its submodule (``amp_patch.apex.normalization.fused_layer_norm``), where
the functional forms and the autograd functions live.
"""
from .fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"]
