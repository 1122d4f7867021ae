"""``apex.contrib.clip_grad.clip_grad``: Apex's multi-tensor ``clip_grad_norm_``.

Apex's version computes what ``torch.nn.utils.clip_grad_norm_`` computes
(the total norm of all gradients; each multiplied by ``max_norm / (total +
1e-6)`` when that is below 1), with multi-tensor kernels; here it is torch's,
with its multi-tensor (``foreach``) kernels.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total ``norm_type`` norm of ``max_norm``, in place.

    Args:
        parameters: a tensor or tensors whose ``.grad`` is clipped.
        max_norm: the largest total norm kept.
        norm_type: the p of the norm (``inf`` for the max norm).
        error_if_nonfinite: raise when the total norm is NaN or infinite.

    Returns:
        The total norm of the gradients before clipping (a 0-d FP32 tensor).

    Example::

        from apex.contrib.clip_grad import clip_grad_norm_
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not any(p.grad is not None for p in params):
        return torch.tensor(0.0)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite, foreach=True)
