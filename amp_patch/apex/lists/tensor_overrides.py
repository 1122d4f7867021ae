"""``apex.amp.lists.tensor_overrides``: Apex's policy lists for ``torch.Tensor``, editable
before ``amp.initialize`` (see ``amp_patch.apex.lists``)."""
import torch

from ._views import fill

MODULE = torch.Tensor
# FP16_FUNCS, FP32_FUNCS, CASTS, SEQUENCE_CASTS, BANNED_FUNCS and BASELINE
fill(globals(), "torch.Tensor")
