"""Stand-in for ``apex.contrib``: the parts training scripts import.

Served: ``clip_grad`` (``clip_grad_norm_``), ``xentropy``
(``SoftmaxCrossEntropyLoss``), ``layer_norm`` (``FastLayerNorm``),
``optimizers`` (``FP16_Optimizer``, ``FusedAdam``, ``FusedLAMB``, ``FusedSGD``,
``distributed_fused_adam.DistributedFusedAdam``) and ``group_norm``
(``GroupNorm``). The rest of ``apex.contrib`` (fused attention, sparsity,
transducer, ...) is not served: importing it names the torch replacement
(``amp_patch.apex.standins.REPLACEMENTS``).

Each served submodule is an attribute too, imported on first use: after a
bare ``import apex``, ``apex.contrib.optimizers.FP16_Optimizer`` works, as in
Apex (where ``import apex`` imported ``apex.amp``, which imported
``apex.contrib.optimizers``).
"""
from .._submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # the submodules not imported above, on first use
