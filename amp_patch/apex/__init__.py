"""Stand-ins for the parts of NVIDIA Apex that current Apex no longer ships.

The apex alias (``amp_patch.install_apex_alias()``, ``amp-patch run``) serves
these modules under Apex's names, only when no real Apex module of that name
can be imported:

* ``apex.parallel``        -> ``amp_patch.apex.parallel``
* ``apex.fp16_utils``      -> ``amp_patch.apex.fp16_utils``
* ``apex.optimizers``      -> ``amp_patch.apex.optimizers``
* ``apex.normalization``   -> ``amp_patch.apex.normalization``
* ``apex.multi_tensor_apply`` -> ``amp_patch.apex.multi_tensor_apply``
* ``apex.contrib``         -> ``amp_patch.apex.contrib`` (clip_grad, xentropy,
  layer_norm, optimizers, group_norm)
* ``apex.mlp``, ``apex.fused_dense``, ``apex.reparameterization``
* ``amp_C``, ``apex_C``, ``fused_adam_cuda``, ``fused_layer_norm_cuda``,
  ``fused_weight_gradient_mlp_cuda``, ``xentropy_cuda`` (Apex's compiled
  extensions) -> the modules of the same name here

Each package has Apex's submodules, so every module path Apex had imports.
``apex.amp`` itself is ``amp_patch.amp`` (its ``lists`` are ``amp_patch.apex.lists``).
Each stand-in keeps Apex's names, constructor arguments and semantics,
computed with torch's own kernels.
"""
