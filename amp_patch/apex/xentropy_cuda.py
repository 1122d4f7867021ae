"""Stand-in for Apex's ``xentropy_cuda`` extension: softmax cross entropy with
label smoothing, row by row, as Apex's kernel computes it.

For logits ``x`` (N x C) and labels ``y``, in FP32::

    lse    = max(x) + log(sum(exp(x - max(x))))
    loss   = (lse - sum(x) / C) * smoothing - (x[y] - lse) * (1 - smoothing)
    dx     = grad * (exp(x - lse) - (1 - smoothing) * onehot(y) - smoothing / C)
"""
from __future__ import annotations

from typing import Tuple

import torch

f32 = torch.float32

__all__ = ["forward", "backward"]


def forward(logits: torch.Tensor, labels: torch.Tensor, smoothing: float,
            half_to_float: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(losses, max_log_sum_exp)``: FP32 losses, and each row's log-sum-exp
    (in the logits' dtype, FP32 with ``half_to_float``).

    Raises:
        RuntimeError: for logits that are not 2-d, labels not 1-d int64 of as
            many rows, or ``half_to_float`` with logits that are not FP16 (Apex's checks).

    Example::

        losses, lse = xentropy_cuda.forward(logits, labels, 0.1, False)
    """
    if half_to_float and logits.dtype != torch.float16:
        raise RuntimeError("conversion is supported for Half type only")
    if labels.dtype != torch.int64:
        raise RuntimeError("Label type should be CUDA Long")
    if logits.dim() != 2:
        raise RuntimeError("Currently only 2 dim input supported")
    if labels.dim() != 1:
        raise RuntimeError("Labels should be 1 dimensional")
    if logits.size(0) != labels.size(0):
        raise RuntimeError("Input and label should have same number of examples")
    x = logits.to(f32)
    lse = torch.logsumexp(x, dim=1)
    picked = x.gather(1, labels.unsqueeze(1)).squeeze(1)
    losses = (lse - x.sum(1) / x.size(1)) * smoothing - (picked - lse) * (1 - smoothing)
    return losses, lse if half_to_float else lse.to(logits.dtype)


def backward(grad_loss: torch.Tensor, logits: torch.Tensor, max_log_sum_exp: torch.Tensor, labels: torch.Tensor,
             smoothing: float) -> torch.Tensor:
    """The gradient of the logits, in their dtype.

    Example::

        grad_logits = xentropy_cuda.backward(grad_losses, logits, lse, labels, 0.1)
    """
    x = logits.to(f32)
    classes = x.size(1)
    grad = torch.exp(x - max_log_sum_exp.to(f32).unsqueeze(1))
    grad.scatter_add_(1, labels.unsqueeze(1), torch.full_like(grad[:, :1], -(1 - smoothing)))
    grad.sub_(smoothing / classes)
    return (grad * grad_loss.to(f32).unsqueeze(1)).to(logits.dtype)
