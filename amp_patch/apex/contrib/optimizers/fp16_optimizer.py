"""``apex.contrib.optimizers.fp16_optimizer``: the fused-era ``FP16_Optimizer``
with one FP32 master per parameter (``amp_patch.apex.optimizers.fp16_optimizer``)."""
from ...optimizers.fp16_optimizer import ContribFP16_Optimizer as FP16_Optimizer

__all__ = ["FP16_Optimizer"]
