"""Stand-in for Apex's ``amp_C`` extension: the multi-tensor kernels training
scripts call directly, on torch's ``torch._foreach_*`` ops.

Each function takes Apex's arguments in Apex's order, ``(chunk_size,
noop_flag, tensor_lists, *args)``, so ``multi_tensor_applier(op, flag,
lists, ...)`` calls it unchanged. ``chunk_size`` only tiled Apex's CUDA
launches and is ignored. Arithmetic is in FP32, as in Apex's kernels, and
the results are written in each output's own dtype. ``noop_flag`` (an int
tensor) is set to 1 where Apex's kernel sets it, without a host sync.

The optimizer kernels that scripts and hand-written optimizers call
(``multi_tensor_adam``, ``multi_tensor_sgd``, ``multi_tensor_lamb`` and
NVIDIA's two-stage LAMB, ``multi_tensor_lamb_stage1_cuda`` /
``multi_tensor_lamb_stage2_cuda``) follow Apex's kernels' formulas, on the
same multi-tensor code the ``apex.optimizers`` stand-ins use. Half tensors
are updated through FP32 copies, rounded once. ``update_scale_hysteresis``
is Apex's loss-scale update with hysteresis, on one-element tensors, bit for
bit. A kernel not provided raises an ``AttributeError`` that names what to
use instead.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .optimizers.common import adam_direction, as_fp32, copy_back
from .optimizers.fused_lamb import lamb

Tensor = torch.Tensor
f32 = torch.float32

__all__ = ["multi_tensor_l2norm", "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_unscale_l2norm",
           "multi_tensor_l2norm_mp", "multi_tensor_l2norm_scale", "multi_tensor_adam", "multi_tensor_sgd",
           "multi_tensor_lamb", "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda",
           "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_adagrad",
           "update_scale_hysteresis"]


def _raise_flag(noop_flag: Tensor, bad: Tensor) -> None:
    """Set ``noop_flag`` to 1 where the 0-d bool ``bad`` is True (no host sync)."""
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def _flag_non_finite(noop_flag: Tensor, tensors: Sequence[Tensor]) -> None:
    """Set ``noop_flag`` to 1 if any of ``tensors`` holds an inf or a NaN."""
    # an inf-norm is inf or NaN exactly when the tensor holds one
    peaks = torch.stack(torch._foreach_norm(list(tensors), float("inf"), dtype=f32))
    _raise_flag(noop_flag, torch.isfinite(peaks).all().logical_not())


#: FP32 elements ``multi_tensor_unscale_l2norm`` multiplies at a time (64 MiB of scaled copies)
_UNSCALE_BATCH = 1 << 24


def _scaled_norms(tensors: List[Tensor], inv: Tensor) -> List[Tensor]:
    """The L2 norm of each ``tensor * inv``, each element multiplied before it
    is squared, in FP32 (Apex's order: a scaled gradient whose square would
    overflow FP32 gives a finite norm once unscaled). The scaled copies are
    made a batch of tensors at a time, so the memory they take stays bounded."""
    out: List[Tensor] = []
    start, size = 0, 0
    for i, t in enumerate(tensors):
        size += t.numel()
        if size >= _UNSCALE_BATCH or i == len(tensors) - 1:
            scaled = torch._foreach_mul([x.to(f32) for x in tensors[start:i + 1]], inv)
            out += torch._foreach_norm(scaled, 2)
            start, size = i + 1, 0
    return out


def _l2norm(noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], per_tensor: bool,
            inv_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``multi_tensor_l2norm``'s result, of the tensors times ``inv_scale``
    when given; raises ``noop_flag`` when the total is not finite.

    Shapes as Apex's kernel returns them: the total ``[1]``, the per-tensor
    norms ``[len(tensors)]``, or ``[0]`` without ``per_tensor``."""
    tensors = list(tensor_lists[0])
    if inv_scale is None:
        norms = torch._foreach_norm(tensors, 2, dtype=f32)
    else:
        inv = torch.as_tensor(inv_scale, dtype=f32, device=tensors[0].device).reshape(-1)[0]
        norms = _scaled_norms(tensors, inv)
    each = torch.stack(norms)
    total = torch.linalg.vector_norm(each).reshape(1)
    _raise_flag(noop_flag, torch.isfinite(total).logical_not().squeeze(0))
    return total, each if per_tensor else each.new_empty(0)


def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                        per_tensor: bool = False) -> Tuple[Tensor, Tensor]:
    """The L2 norm of all tensors of ``tensor_lists[0]`` together, and of each.

    Sets ``noop_flag`` to 1 when a norm is not finite.

    Args:
        chunk_size: ignored (Apex's CUDA tiling).
        noop_flag: an int tensor of one element.
        tensor_lists: ``[tensors]``.
        per_tensor: also return each tensor's norm.

    Returns:
        ``(total, per_tensor_norms)``, FP32: ``total`` of shape ``[1]``,
        ``per_tensor_norms`` of shape ``[len(tensors)]``, or ``[0]`` when
        ``per_tensor`` is False.

    Example::

        import amp_C
        from apex.multi_tensor_apply import multi_tensor_applier
        flag = torch.zeros(1, dtype=torch.int)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)
    """
    return _l2norm(noop_flag, tensor_lists, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                inv_scale: Tensor, per_tensor: bool = False) -> Tuple[Tensor, Tensor]:
    """``multi_tensor_l2norm`` of the tensors multiplied by ``inv_scale``, the tensors left as they are.

    Each element is multiplied by ``inv_scale`` before it is squared, in FP32,
    as in Apex's kernel. Sets ``noop_flag`` to 1 when the total is not finite.

    Args:
        chunk_size: ignored (Apex's CUDA tiling).
        noop_flag: an int tensor of one element.
        tensor_lists: ``[tensors]``.
        inv_scale: a one-element FP32 tensor (1 / loss scale).
        per_tensor: also return each tensor's norm.

    Returns:
        ``(total, per_tensor_norms)``, as ``multi_tensor_l2norm``: ``total`` of
        shape ``[1]`` (Apex's kernel returns a one-element tensor, not a 0-d one).

    Example::

        inv = torch.tensor([1 / 65536.0])
        total, _ = amp_C.multi_tensor_unscale_l2norm(2048 * 32, flag, [grads], inv, False)
    """
    return _l2norm(noop_flag, tensor_lists, per_tensor, inv_scale)


def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                       scale: float) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists = [srcs, dsts]``.

    Computed in FP32 and written in each ``dst``'s dtype (``dst`` may be
    ``src``). Sets ``noop_flag`` to 1 when a ``src`` holds an inf or a NaN;
    the outputs are written either way, as Apex's kernel does.

    Args:
        chunk_size: ignored (Apex's CUDA tiling).
        noop_flag: an int tensor of one element.
        tensor_lists: ``[srcs, dsts]``, of equal length and matching shapes.
        scale: the factor.

    Example::

        # unscale FP16 gradients into FP32 master gradients, noting an overflow
        flag = torch.zeros(1, dtype=torch.int)
        amp_C.multi_tensor_scale(2048 * 32, flag, [half_grads, master_grads], 1.0 / loss_scale)
        overflow = bool(flag.item())
    """
    srcs, dsts = list(tensor_lists[0]), list(tensor_lists[1])
    if not srcs:
        return
    _flag_non_finite(noop_flag, srcs)
    out = torch._foreach_mul([s.to(f32) for s in srcs], scale)
    torch._foreach_copy_(dsts, out)


def multi_tensor_axpby(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                       a: float, b: float, arg_to_check: int) -> None:
    """``out = a * x + b * y`` for each triple of ``tensor_lists = [xs, ys, outs]``.

    Computed in FP32 and written in each ``out``'s dtype. Sets ``noop_flag``
    to 1 when a checked input holds an inf or a NaN: ``arg_to_check`` 0
    checks ``x``, 1 checks ``y``, -1 checks both (Apex's codes).

    Args:
        chunk_size: ignored (Apex's CUDA tiling).
        noop_flag: an int tensor of one element.
        tensor_lists: ``[xs, ys, outs]``.
        a: the factor of ``x``.
        b: the factor of ``y``.
        arg_to_check: 0, 1 or -1.

    Example::

        # master_grad = fp16_grad / scale + master_grad (gradient accumulation)
        amp_C.multi_tensor_axpby(2048 * 32, flag, [half_grads, master_grads, master_grads], 1 / scale, 1.0, 0)
    """
    xs, ys, outs = (list(t) for t in tensor_lists)
    if not xs:
        return
    checked = {0: xs, 1: ys, -1: xs + ys}.get(arg_to_check)
    if checked is None:
        raise ValueError(f"multi_tensor_axpby: arg_to_check must be 0 (x), 1 (y) or -1 (both), not {arg_to_check!r}")
    _flag_non_finite(noop_flag, checked)
    out = torch._foreach_mul([x.to(f32) for x in xs], a)
    torch._foreach_add_(out, [y.to(f32) for y in ys], alpha=b)
    torch._foreach_copy_(outs, out)


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                           per_tensor: bool = False) -> Tuple[Tensor, Tensor]:
    """``multi_tensor_l2norm`` for lists of mixed dtypes (Apex's ``_mp`` form; here the same).

    Example::

        total, _ = amp_C.multi_tensor_l2norm_mp(65536, flag, [half_and_fp32_grads], False)
    """
    return _l2norm(noop_flag, tensor_lists, per_tensor)


def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                              scale: float, per_tensor: bool = False) -> Tuple[Tensor, Tensor]:
    """``out = in * scale`` for ``tensor_lists = [ins, outs]``, and the L2 norms of ``ins`` (before scaling).

    Sets ``noop_flag`` to 1 when the total norm is not finite.

    Example::

        norm, _ = amp_C.multi_tensor_l2norm_scale(65536, flag, [grads, grads], 1 / loss_scale, False)
    """
    result = _l2norm(noop_flag, tensor_lists[:1], per_tensor)
    ins, outs = list(tensor_lists[0]), list(tensor_lists[1])
    if ins:
        torch._foreach_copy_(outs, torch._foreach_mul([t.to(f32) for t in ins], scale))
    return result


def _first(t: Tensor, dtype: torch.dtype, what: str) -> Tensor:
    """A view of the element at ``t``'s data pointer (what Apex's one-thread kernel reads and writes)."""
    if t.dtype != dtype:
        raise RuntimeError(f"update_scale_hysteresis: {what} must be a {dtype} tensor (Apex's kernel reads it "
                           f"as one), not {t.dtype}")
    if t.numel() == 0:
        raise RuntimeError(f"update_scale_hysteresis: {what} is empty; it needs one element")
    return t.as_strided((1,), (1,))


def _flush(x: Tensor) -> Tensor:
    """FP32 ``x`` with subnormals flushed to zero of the same sign, as Apex's
    kernel (built with ``--use_fast_math``) reads and writes floats."""
    return torch.where(x.abs() < torch.finfo(f32).tiny, x * 0, x)


def update_scale_hysteresis(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                            found_inf: Tensor, growth_factor: float, backoff_factor: float, growth_interval: int,
                            hysteresis: int) -> Tensor:
    """Apex's dynamic loss-scale update with hysteresis, in place, without a host sync.

    The scale backs off only after ``hysteresis`` overflowing steps in a row.
    On each call, with ``found_inf`` read as Apex's kernel reads it:

    * ``found_inf > 0``: ``hysteresis_tracker -= 1``; while it stays above 0,
      ``growth_tracker = 0`` and nothing else changes;
    * otherwise, ``found_inf != 0`` (an overflow, NaN included): ``scale *=
      backoff_factor`` (no check for underflow: a product below FP32's
      smallest normal becomes 0) and ``growth_tracker = 0``;
    * ``found_inf == 0``: ``growth_tracker += 1``; on reaching
      ``growth_interval`` the scale is multiplied by ``growth_factor`` unless
      that is not finite, and ``growth_tracker = 0``;
    * ``found_inf <= 0`` (no overflow): ``hysteresis_tracker = hysteresis``.

    Products are taken in FP64 and rounded once to FP32, and subnormal FP32
    values count as 0, as in Apex's kernel.

    Args:
        current_scale: FP32, one element: the loss scale, updated.
        growth_tracker: int32, one element: clean steps since the last change, updated.
        hysteresis_tracker: int32, one element: overflows still tolerated, updated.
        found_inf: FP32, one element: above 0 when this step overflowed.
        growth_factor: the scale's factor after ``growth_interval`` clean steps.
        backoff_factor: the scale's factor on a counted overflow.
        growth_interval: clean steps between growths.
        hysteresis: overflows in a row before the scale backs off.

    Returns:
        ``current_scale``.

    Raises:
        RuntimeError: a tensor of another dtype, or empty.

    Example::

        scale = torch.tensor([65536.0])
        growth = torch.zeros(1, dtype=torch.int32)
        hyst = torch.tensor([2], dtype=torch.int32)
        amp_C.update_scale_hysteresis(scale, growth, hyst, found_inf, 2.0, 0.5, 2000, 2)
    """
    scale = _first(current_scale, f32, "current_scale")
    growth = _first(growth_tracker, torch.int32, "growth_tracker")
    hyst = _first(hysteresis_tracker, torch.int32, "hysteresis_tracker")
    found = _flush(_first(found_inf, f32, "found_inf").to(scale.device))
    s = _flush(scale)
    counted = found > 0
    left = hyst - counted.to(torch.int32)
    waits = counted & (left > 0)  # an overflow hysteresis still absorbs
    overflow = found != 0
    backed = _flush((s.double() * backoff_factor).to(f32))
    grown = _flush((s.double() * growth_factor).to(f32))
    successful = growth + 1
    due = successful == growth_interval
    new_scale = torch.where(overflow, backed, torch.where(due & torch.isfinite(grown), grown, scale))
    scale.copy_(torch.where(waits, scale, new_scale))
    growth.copy_(torch.where(waits | overflow | due, torch.zeros_like(growth), successful))
    hyst.copy_(torch.where(found <= 0, torch.full_like(left, hysteresis), left))
    return current_scale


def _step_noop(noop_flag: Tensor) -> bool:
    """True when a kernel that honours the flag must do nothing (asks the device)."""
    return bool(noop_flag.reshape(-1)[0].item() != 0)


def multi_tensor_adam(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """Apex's Adam kernel over ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``, in place.

    ``step`` is the step being taken (from 1); ``mode`` 0 adds
    ``weight_decay * p`` to the gradient (Adam's L2), 1 adds it to the update
    (AdamW): ``p -= lr * (m_hat / (sqrt(v_hat) + eps) [+ weight_decay * p])``.

    Example::

        group["step"] += 1
        multi_tensor_applier(amp_C.multi_tensor_adam, flag, [grads, params, exp_avgs, exp_avg_sqs],
                             1e-3, 0.9, 0.999, 1e-8, group["step"], 1, 1, 0.01)
    """
    gs, ps, ms, vs = (list(t) for t in tensor_lists)
    if not ps:
        return
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction == 1 else (1.0, 1.0)
    work, work_m, work_v = as_fp32(ps), as_fp32(ms), as_fp32(vs)
    update = adam_direction(work, as_fp32(gs), work_m, work_v, beta1=beta1, beta2=beta2, beta3=1 - beta1,
                             eps=epsilon, bias_correction1=bc1, bias_correction2=bc2, weight_decay=weight_decay,
                             adam_w_mode=mode == 1)
    torch._foreach_add_(work, update, alpha=-lr)
    copy_back(ps + ms + vs, work + work_m + work_v)


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                 lr: Tensor, beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    """Apex's capturable Adam kernel: ``multi_tensor_adam`` with ``lr`` and
    ``step`` as tensors, the gradients first multiplied by ``inv_scale`` (and
    written back unscaled, as Apex's kernel does), and nothing done when
    ``noop_flag`` is set (an overflow found before).

    Example::

        amp_C.multi_tensor_adam_capturable(65536, found_inf, [grads, params, ms, vs], lr_t, 0.9, 0.999,
                                           1e-8, step_t, 1, 1, 0.01, 1 / scale_t)
    """
    _adam_capturable(noop_flag, tensor_lists, None, lr, beta1, beta2, epsilon, step, mode, bias_correction,
                     weight_decay, inv_scale)


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                        lr: Tensor, beta1: float, beta2: float, epsilon: float, step: Tensor,
                                        mode: int, bias_correction: int, weight_decay: float,
                                        inv_scale: Tensor) -> None:
    """``multi_tensor_adam_capturable`` over ``[grads, params, ms, vs, masters]``:
    the FP32 ``masters`` are updated and the (half) ``params`` receive them.

    Example::

        amp_C.multi_tensor_adam_capturable_master(65536, found_inf, [grads, params, ms, vs, masters], lr_t,
                                                  0.9, 0.999, 1e-8, step_t, 1, 1, 0.01, 1 / scale_t)
    """
    _adam_capturable(noop_flag, tensor_lists[:4], list(tensor_lists[4]), lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)


def _adam_capturable(noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], masters: Optional[List[Tensor]],
                     lr: Tensor, beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                     bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    gs, ps, ms, vs = (list(t) for t in tensor_lists)
    if not ps or _step_noop(noop_flag):
        return
    grads = torch._foreach_mul([g.to(f32) for g in gs], inv_scale.to(f32).reshape(()))
    torch._foreach_copy_(gs, grads)  # Apex's kernel leaves the unscaled gradients behind
    t = float(step.reshape(-1)[0])
    bc1, bc2 = (1 - beta1 ** t, 1 - beta2 ** t) if bias_correction == 1 else (1.0, 1.0)
    targets = masters if masters is not None else ps
    work, work_m, work_v = as_fp32(targets), as_fp32(ms), as_fp32(vs)
    update = adam_direction(work, grads, work_m, work_v, beta1=beta1, beta2=beta2, beta3=1 - beta1, eps=epsilon,
                             bias_correction1=bc1, bias_correction2=bc2, weight_decay=weight_decay,
                             adam_w_mode=mode == 1)
    torch._foreach_mul_(update, lr.to(f32).reshape(()))
    torch._foreach_sub_(work, update)
    copy_back(targets + ms + vs, work + work_m + work_v)
    if masters is not None:
        torch._foreach_copy_(ps, work)


def multi_tensor_adagrad(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], lr: float,
                         epsilon: float, mode: int, weight_decay: float) -> None:
    """Apex's Adagrad kernel over ``[grads, params, sums]``, in place: ``mode`` 0
    adds ``weight_decay * p`` to the gradient, 1 to the step;
    ``sum += g * g``; ``p -= lr * (g / (sqrt(sum) + eps) [+ weight_decay * p])``.

    Example::

        amp_C.multi_tensor_adagrad(65536, flag, [grads, params, sums], 1e-2, 1e-10, 0, 1e-4)
    """
    gs, ps, hs = (list(t) for t in tensor_lists)
    if not ps:
        return
    work, work_h = as_fp32(ps), as_fp32(hs)
    g = [x.to(f32) for x in gs]
    if mode == 0 and weight_decay != 0:
        g = torch._foreach_add(g, work, alpha=weight_decay)
    torch._foreach_addcmul_(work_h, g, g)
    denom = torch._foreach_sqrt(work_h)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(g, denom)
    if mode == 1 and weight_decay != 0:
        torch._foreach_add_(update, work, alpha=weight_decay)
    torch._foreach_add_(work, update, alpha=-lr)
    copy_back(ps + hs, work + work_h)


def multi_tensor_sgd(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], wd: float,
                     momentum: float, dampening: float, lr: float, nesterov: bool, first_run: bool,
                     wd_after_momentum: bool, scale: float) -> None:
    """Apex's SGD kernel over ``tensor_lists = [grads, params, momentum_buffers]``
    (plus ``[FP16 model weights]`` to receive a copy of the updated params), in place.

    Skipped entirely when ``noop_flag`` is set (an overflow found earlier), as
    Apex's kernel is. Per element, in FP32: ``g = grad * scale``; ``g += wd * p``
    (before the momentum unless ``wd_after_momentum``); ``buf = g`` on the
    first run, else ``momentum * buf + (1 - dampening) * g``; ``g += momentum *
    buf`` (Nesterov) or ``g = buf``; ``p -= lr * g``.

    Example::

        multi_tensor_applier(amp_C.multi_tensor_sgd, flag, [grads, params, bufs], 5e-4, 0.9, 0.0, 0.1,
                             False, first_run, False, 1.0 / loss_scale)
    """
    gs, ps, bufs = (list(t) for t in tensor_lists[:3])
    copies = list(tensor_lists[3]) if len(tensor_lists) > 3 else []
    if not ps or _step_noop(noop_flag):
        return
    g = torch._foreach_mul([t.to(f32) for t in gs], scale)
    work, work_bufs = as_fp32(ps), as_fp32(bufs)
    if wd != 0 and not wd_after_momentum:
        torch._foreach_add_(g, work, alpha=wd)
    if momentum != 0:
        if first_run:
            torch._foreach_copy_(work_bufs, g)
        else:
            torch._foreach_mul_(work_bufs, momentum)
            torch._foreach_add_(work_bufs, g, alpha=1 - dampening)
        if nesterov:
            torch._foreach_add_(g, work_bufs, alpha=momentum)
        else:
            g = [b.clone() for b in work_bufs]
    if wd != 0 and wd_after_momentum:
        torch._foreach_add_(g, work, alpha=wd)
    torch._foreach_add_(work, g, alpha=-lr)
    copy_back(ps + (bufs if momentum != 0 else []), work + (work_bufs if momentum != 0 else []))
    if copies:
        torch._foreach_copy_(copies, work)


def multi_tensor_lamb(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, bias_correction: int,
                      weight_decay: float, grad_averaging: int, mode: int, global_grad_norm: Tensor,
                      max_grad_norm: float, use_nvlamb: bool = False) -> None:
    """Apex's LAMB kernel over ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``,
    in place: the gradients divided by ``global_grad_norm / max_grad_norm``
    when that exceeds 1, an Adam direction (``mode`` 0: L2, 1: decoupled
    decay), scaled per tensor by the trust ratio ``||p|| / ||update||``
    (for decaying tensors, or all with ``use_nvlamb``). The gradients are left
    as they are (Apex's kernel overwrote them with the update).

    Example::

        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)
        multi_tensor_applier(amp_C.multi_tensor_lamb, flag, [grads, params, exp_avgs, exp_avg_sqs], 1e-3,
                             0.9, 0.999, 1e-6, step, 1, 0.01, 1, 1, norm, 1.0)
    """
    gs, ps, ms, vs = (list(t) for t in tensor_lists)
    if not ps:
        return
    norm = global_grad_norm.to(f32).reshape(())
    clip = torch.where(norm > max_grad_norm, norm / max_grad_norm, torch.ones_like(norm))
    work, work_m, work_v = as_fp32(ps), as_fp32(ms), as_fp32(vs)
    lamb(work, as_fp32(gs), work_m, work_v, lr=lr, beta1=beta1, beta2=beta2, eps=epsilon, step=step,
          bias_correction=bias_correction == 1, weight_decay=weight_decay, grad_averaging=grad_averaging == 1,
          adam_w_mode=mode == 1, clip=clip, use_nvlamb=bool(use_nvlamb))
    copy_back(ps + ms + vs, work + work_m + work_v)


def multi_tensor_lamb_stage1_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                  per_tensor_decay: Tensor, step: int, beta1: float, beta2: float, epsilon: float,
                                  global_grad_norm: Tensor, max_global_grad_norm: float) -> None:
    """Stage 1 of NVIDIA's two-stage LAMB, over ``tensor_lists = [grads, params,
    exp_avgs, exp_avg_sqs, updates]``: moves the moments and writes each update.

    Per element, in FP32, with ``clip = norm / max_global_grad_norm`` when the
    global norm exceeds ``max_global_grad_norm`` (else 1) and the bias
    corrections of step ``step + 1``::

        g = grad / clip
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
        update = (m / (1 - beta1**(step+1))) / (sqrt(v / (1 - beta2**(step+1))) + eps) + decay[i] * p

    Args:
        per_tensor_decay: one FP32 weight decay per tensor.
        step: the number of steps taken before this one.
        global_grad_norm: a one-element FP32 tensor.

    Example::

        multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, flag, [grads, params, ms, vs, updates],
                             decays, step, 0.9, 0.999, 1e-6, global_norm, 1.0)
    """
    gs, ps, ms, vs, ups = (list(t) for t in tensor_lists)
    if not ps:
        return
    norm = global_grad_norm.to(f32).reshape(-1)[0]
    clip = torch.where(norm > max_global_grad_norm, norm / max_global_grad_norm, torch.ones_like(norm))
    t = float(step + 1)
    work_m, work_v = as_fp32(ms), as_fp32(vs)
    g = torch._foreach_div([x.to(f32) for x in gs], clip)
    torch._foreach_mul_(work_m, beta1)
    torch._foreach_add_(work_m, g, alpha=1 - beta1)
    torch._foreach_mul_(work_v, beta2)
    torch._foreach_addcmul_(work_v, g, g, value=1 - beta2)
    denom = torch._foreach_div(work_v, 1 - beta2 ** t)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(work_m, 1 - beta1 ** t)
    torch._foreach_div_(update, denom)
    decays = per_tensor_decay.to(f32).reshape(-1)
    torch._foreach_add_(update, torch._foreach_mul([p.to(f32) for p in ps], list(decays[:len(ps)].unbind())))
    copy_back(ms + vs, work_m + work_v)
    torch._foreach_copy_(ups, update)


def multi_tensor_lamb_stage2_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]],
                                  per_tensor_param_norm: Tensor, per_tensor_update_norm: Tensor, lr: float,
                                  weight_decay: float, use_nvlamb: Optional[bool] = None) -> None:
    """Stage 2 of NVIDIA's two-stage LAMB, over ``tensor_lists = [params, updates]``:
    ``p -= ratio * update``, ``ratio = lr * ||p|| / ||update||`` (``lr`` where
    either norm is 0) when ``weight_decay != 0`` or ``use_nvlamb``, else ``lr``.

    Example::

        multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, flag, [params, updates],
                             param_norms, update_norms, lr, weight_decay, False)
    """
    ps, ups = list(tensor_lists[0]), list(tensor_lists[1])
    if not ps:
        return
    n = len(ps)
    if use_nvlamb or weight_decay != 0:
        w = per_tensor_param_norm.to(f32).reshape(-1)[:n]
        u = per_tensor_update_norm.to(f32).reshape(-1)[:n]
        ratios: List = list(torch.where((w != 0) & (u != 0), lr * (w / u), torch.full_like(w, lr)).unbind())
    else:
        ratios = [lr] * n
    work = as_fp32(ps)
    steps = torch._foreach_mul([x.to(f32) for x in ups], ratios)
    torch._foreach_sub_(work, steps)
    copy_back(ps, work)


#: Apex kernels this module does not provide -> what to use instead
_INSTEAD = {
    "multi_tensor_lamb_mp": "apex.optimizers.FusedMixedPrecisionLamb (amp_patch.apex.optimizers)",
    "multi_tensor_novograd": "apex.optimizers.FusedNovoGrad (amp_patch.apex.optimizers)",
}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    instead = _INSTEAD.get(name, "the torch._foreach_* ops (torch._foreach_mul_, torch._foreach_norm, ...)")
    raise AttributeError(
        f"amp_C.{name} is not provided: amp_patch's amp_C (a stand-in for Apex's) has only "
        f"{', '.join(__all__)}. Use {instead}."
    )
