"""Stand-in for ``apex.optimizers``: ``FusedAdam``, ``FusedAdagrad``,
``FusedSGD``, ``FusedLAMB``, ``FusedNovoGrad`` and ``FusedMixedPrecisionLamb``,
with Apex's constructor arguments and defaults, its param-group keys and its
state layout (so Apex checkpoints load), on any device.

Kernels: Adam (with bias correction), SGD and Adagrad run torch's own update,
``torch.optim.adam.adam`` (its fused kernel on CPU and CUDA) and
``torch.optim.sgd.sgd`` / ``torch.optim.adagrad.adagrad`` with
``foreach=True``; Apex's decoupled weight decay variants of SGD and Adagrad
are one multi-tensor multiply before them. LAMB, NovoGrad and Adam without
bias correction, which torch lacks, are written here once each on
``torch._foreach_*`` ops, following Apex's kernels.

Half (FP16/BF16) parameters are updated as Apex's kernels update them: the
arithmetic in FP32, rounded once into the parameter. Their state keeps Apex's
dtypes (FP32 moments for Adam, the parameter's dtype for the others), and
``load_state_dict`` keeps each state tensor's saved dtype where torch would
cast it to the parameter's.

They are ordinary ``torch.optim.Optimizer`` subclasses: amp_patch's O2/O5
hands them FP32 master weights like any optimizer, and ``zero_grad()``
follows each one's ``set_grad_none``.
"""
from __future__ import annotations

from .fp16_optimizer import FP16_Optimizer
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdagrad", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedMixedPrecisionLamb",
           "FP16_Optimizer"]
