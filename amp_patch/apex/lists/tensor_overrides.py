"""``apex.amp.lists.tensor_overrides``: Apex's policy lists for ``torch.Tensor``, editable
before ``amp.initialize`` (see ``amp_patch.apex.lists``)."""
import torch

from ._views import lists_of

MODULE = torch.Tensor
_lists = lists_of("torch.Tensor")
FP16_FUNCS = _lists["FP16_FUNCS"]
FP32_FUNCS = _lists["FP32_FUNCS"]
CASTS = _lists["CASTS"]
SEQUENCE_CASTS = _lists["SEQUENCE_CASTS"]
BANNED_FUNCS = _lists["BANNED_FUNCS"]
#: the contents as shipped, per policy, against which edits are read
BASELINE = {"half": list(FP16_FUNCS), "float": list(FP32_FUNCS), "promote": list(CASTS),
            "sequence_promote": list(SEQUENCE_CASTS), "banned": list(BANNED_FUNCS)}
del _lists
