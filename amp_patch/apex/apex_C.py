"""Stand-in for Apex's ``apex_C`` extension: ``flatten`` and ``unflatten``,
which pre-2020 DDP code (Apex's own, fairseq's, Megatron's) imports to pack
gradients into one buffer; they are torch's ``_flatten_dense_tensors`` and
``_unflatten_dense_tensors``, which Apex's C++ called too.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-d tensor holding ``tensors`` one after the other.

    Example::

        import apex_C
        flat = apex_C.flatten([p.grad for p in params])
    """
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped as ``tensors``, in order.

    Example::

        for g, new in zip(grads, apex_C.unflatten(flat, grads)):
            g.copy_(new)
    """
    return list(_unflatten_dense_tensors(flat, list(tensors)))
