"""``apex.contrib.xentropy.softmax_xentropy``: Apex's fused softmax cross
entropy with label smoothing, on the ``xentropy_cuda`` stand-in."""
from __future__ import annotations

from typing import Any

import torch

from ... import xentropy_cuda

__all__ = ["SoftmaxCrossEntropyLoss"]


class SoftmaxCrossEntropyLoss(torch.autograd.Function):
    """Per-row cross entropy of ``logits`` (N x C) against ``labels`` (N), with label smoothing.

    ``loss = (1 - smoothing) * -log_softmax(x)[label] + smoothing * -mean(log_softmax(x))``;
    rows whose label is ``padding_idx`` get 0 and no gradient. The losses are
    FP32 (as Apex's kernel); ``half_to_float`` also keeps the saved
    log-sum-exp in FP32 for FP16 logits. The gradient has the logits' dtype.

    Example::

        from apex.contrib.xentropy import SoftmaxCrossEntropyLoss
        losses = SoftmaxCrossEntropyLoss.apply(logits, labels, 0.1, padding_idx, True)
        loss = losses.sum() / (labels != padding_idx).sum()
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0, padding_idx: int = 0,
                half_to_float: bool = False) -> torch.Tensor:
        losses, max_log_sum_exp = xentropy_cuda.forward(logits, labels, smoothing, half_to_float)
        losses.masked_fill_(labels == padding_idx, 0)
        ctx.save_for_backward(logits, max_log_sum_exp, labels)
        ctx.smoothing, ctx.padding_idx = smoothing, padding_idx
        return losses

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Any:
        logits, max_log_sum_exp, labels = ctx.saved_tensors
        grad_loss = grad_loss.contiguous().masked_fill(labels == ctx.padding_idx, 0)
        grad_logits = xentropy_cuda.backward(grad_loss, logits, max_log_sum_exp, labels, ctx.smoothing)
        return grad_logits, None, None, None, None
