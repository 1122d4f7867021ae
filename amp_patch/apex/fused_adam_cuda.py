"""Stand-in for Apex's ``fused_adam_cuda`` extension: the pre-2020 fused Adam
kernel that Apex's first ``FusedAdam`` (now ``apex.contrib.optimizers``) and
copies of it (fairseq's ``FusedAdamV1``, OpenNMT's) call directly.

Scripts import it to learn whether the fused path exists, then call
``fused_adam_cuda.adam(p, p_copy, m, v, g, lr, beta1, beta2, eps,
grad_scale, step, mode, bias_correction, decay)`` per parameter. The
kernel's update, in FP32, for ``p`` FP32 (``m``, ``v`` in ``p``'s dtype; ``g``
FP32 or half)::

    g' = g / grad_scale
    m  = beta1 * m + (1 - beta1) * g'
    v  = beta2 * v + (1 - beta2) * g' * g'
    denom = sqrt(v + eps)          (mode 0: eps inside the square root)
            sqrt(v) + eps          (mode 1)
    step_size = lr * sqrt(1 - beta2**step) / (1 - beta1**step)   (bias_correction 1; else lr)
    p -= step_size * (m / denom + decay * p)
    p_copy = p, rounded to p_copy's dtype    (when p_copy is not empty)

Half ``p`` (which Apex's kernel refused) is updated through an FP32 copy.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

Tensor = torch.Tensor
f32 = torch.float32

__all__ = ["adam", "adam_mt", "step_size"]


def step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: int) -> float:
    """The kernel's step size: ``lr * sqrt(1 - beta2**step) / (1 - beta1**step)``, or ``lr``."""
    if not bias_correction:
        return float(lr)
    return float(lr) * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)


def adam_foreach(params: List[Tensor], copies: Sequence[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
                 grads: Sequence[Tensor], lr: float, beta1: float, beta2: float, eps: float, grad_scale: float,
                 step: int, mode: int, bias_correction: int, decay: float) -> None:
    """The kernel over lists of tensors that share ``step``; ``copies`` may be
    empty (no reduced-precision copy written)."""
    if not params:
        return
    work = [p.float() if p.dtype != f32 else p for p in params]
    ms = [m.float() if m.dtype != f32 else m for m in exp_avgs]
    vs = [v.float() if v.dtype != f32 else v for v in exp_avg_sqs]
    g = torch._foreach_div([t.to(f32) for t in grads], float(grad_scale))
    torch._foreach_mul_(ms, beta1)
    torch._foreach_add_(ms, g, alpha=1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, g, g, value=1 - beta2)
    if mode == 0:
        denom = torch._foreach_add(vs, eps)
        torch._foreach_sqrt_(denom)
    else:
        denom = torch._foreach_sqrt(vs)
        torch._foreach_add_(denom, eps)
    update = torch._foreach_div(ms, denom)
    if decay != 0:
        torch._foreach_add_(update, work, alpha=decay)
    torch._foreach_add_(work, update, alpha=-step_size(lr, beta1, beta2, step, bias_correction))
    for dst, src in ((params, work), (exp_avgs, ms), (exp_avg_sqs, vs)):
        pairs = [(d, s) for d, s in zip(dst, src) if d is not s]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    if copies:
        torch._foreach_copy_(list(copies), work)


def adam(p: Tensor, p_copy: Tensor, m: Tensor, v: Tensor, g: Tensor, lr: float, beta1: float, beta2: float,
         eps: float, grad_scale: float, step: int, mode: int, bias_correction: int, decay: float) -> None:
    """Apex's ``fused_adam_cuda.adam``: one Adam step of ``p`` in place (see the module's formula).

    Args:
        p: the parameter (FP32 master weights in Apex's use).
        p_copy: an empty tensor, or a tensor of ``p``'s size that receives the updated ``p`` (e.g. FP16 model weights).
        m, v: the first and second moments, updated in place.
        g: the gradient, multiplied by ``grad_scale``.
        lr, beta1, beta2, eps, decay: Adam's hyper-parameters.
        grad_scale: what ``g`` is divided by first (the loss scale, times a clipping factor).
        step: the step number, from 1.
        mode: 0 for ``eps`` inside the square root, 1 outside.
        bias_correction: 1 to correct the moments' bias, 0 not to.

    Raises:
        RuntimeError: when the sizes disagree, with the kernel's messages.

    Example::

        import fused_adam_cuda
        state["step"] += 1
        fused_adam_cuda.adam(p32, p16, state["exp_avg"], state["exp_avg_sq"], p16.grad, 1e-3,
                             0.9, 0.999, 1e-8, loss_scale, state["step"], 1, 1, 0.0)
    """
    n = p.numel()
    for what, t in (("m", m), ("v", v), ("g", g)):
        if t.numel() != n:
            raise RuntimeError(f"number of elements in {what} and p tensors should be equal")
    if p_copy.numel() not in (0, n):
        raise RuntimeError("number of elements in p_copy and p tensors should be equal, or p_copy should be empty")
    adam_foreach([p], [p_copy] if p_copy.numel() else [], [m], [v], [g], lr, beta1, beta2, eps, grad_scale, step,
                 mode, bias_correction, decay)


def adam_mt(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], lr: float, beta1: float,
            beta2: float, eps: float, grad_scale: float, step: int, mode: int, bias_correction: int,
            decay: float) -> None:
    """Apex's ``fused_adam_cuda.adam_mt``: ``adam`` over ``tensor_lists = [ps, ms, vs, gs]``
    (or ``[ps, ms, vs, gs, p_copies]``), called through ``multi_tensor_applier``.

    Example::

        multi_tensor_applier(fused_adam_cuda.adam_mt, flag, [ps, ms, vs, gs], 1e-3, 0.9, 0.999, 1e-8,
                             1.0, step, 1, 1, 0.0)
    """
    ps, ms, vs, gs = (list(t) for t in tensor_lists[:4])
    copies = list(tensor_lists[4]) if len(tensor_lists) > 4 else []
    adam_foreach(ps, copies, ms, vs, gs, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"fused_adam_cuda.{name} is not provided: amp_patch's fused_adam_cuda (a stand-in for Apex's) has only "
        f"adam and adam_mt. Use apex.optimizers.FusedAdam, or torch.optim.AdamW(fused=True)."
    )
