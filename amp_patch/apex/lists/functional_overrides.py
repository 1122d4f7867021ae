"""``apex.amp.lists.functional_overrides``: Apex's policy lists for ``torch.nn.functional``, editable
before ``amp.initialize`` (see ``amp_patch.apex.lists``)."""
import torch

from ._views import fill

MODULE = torch.nn.functional
# FP16_FUNCS, FP32_FUNCS, CASTS, SEQUENCE_CASTS, BANNED_FUNCS and BASELINE
fill(globals(), "torch.nn.functional")
