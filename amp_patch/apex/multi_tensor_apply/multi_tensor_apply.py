"""Stand-in for ``apex.multi_tensor_apply.multi_tensor_apply``: ``MultiTensorApply``,
the launcher scripts call Apex's ``amp_C`` kernels through.

Apex's launcher hands the op a chunk size that tiles its CUDA launches; here
the ops are ``amp_patch.apex.amp_C``'s, built on torch's multi-tensor
(``torch._foreach_*``) kernels, which need no tiling, so the launcher only
forwards the call. It is always ``available``: the kernels are plain torch.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["MultiTensorApply"]


class MultiTensorApply:
    """Calls a multi-tensor op as ``op(chunk_size, noop_flag, tensor_lists, *args)``.

    ``available`` and ``warned`` are class attributes, as in Apex, which
    scripts read to choose their fused path.

    Args:
        chunk_size: passed to every op as its first argument.

    Example::

        from apex.multi_tensor_apply import multi_tensor_applier
        import amp_C
        flag = torch.zeros(1, dtype=torch.int)
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, grads], 1.0 / 128)
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raises here when its extension is missing; these kernels are always there."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)
