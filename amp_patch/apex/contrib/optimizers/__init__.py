"""``apex.contrib.optimizers``: Apex's first fused optimizers, kept in contrib:
``FP16_Optimizer`` (one FP32 master per parameter), ``FusedAdam`` (the
pre-2020 kernel and ``step(grads=, output_params=, scale=, grad_norms=)``),
``FusedLAMB``, ``FusedSGD``, and ``distributed_fused_adam.DistributedFusedAdam``."""
from ..._submodules import submodule_getattr
from .fp16_optimizer import FP16_Optimizer
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_sgd import FusedSGD

__all__ = ["FP16_Optimizer", "FusedAdam", "FusedLAMB", "FusedSGD"]

__getattr__ = submodule_getattr(__name__)  # the submodules not imported above, on first use
