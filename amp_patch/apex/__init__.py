"""Stand-ins for the parts of NVIDIA Apex that current Apex no longer ships.

The apex alias (``amp_patch.install_apex_alias()``, ``amp-patch run``) serves
these modules under Apex's names, only when no real Apex module of that name
can be imported:

* ``apex.parallel``        -> ``amp_patch.apex.parallel``
* ``apex.fp16_utils``      -> ``amp_patch.apex.fp16_utils``
* ``apex.optimizers``      -> ``amp_patch.apex.optimizers``
* ``apex.normalization``   -> ``amp_patch.apex.normalization``
* ``apex.multi_tensor_apply`` -> ``amp_patch.apex.multi_tensor_apply``
* ``amp_C``                -> ``amp_patch.apex.amp_C``

``apex.amp`` itself is ``amp_patch.amp``. Each stand-in keeps Apex's names,
constructor arguments and semantics, computed with torch's own kernels.
"""
