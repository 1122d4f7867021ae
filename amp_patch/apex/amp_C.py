"""Stand-in for Apex's ``amp_C`` extension: the multi-tensor kernels training
scripts call directly, on torch's ``torch._foreach_*`` ops.

Each function takes Apex's arguments in Apex's order, ``(chunk_size,
noop_flag, tensor_lists, *args)``, so ``multi_tensor_applier(op, flag,
lists, ...)`` calls it unchanged. ``chunk_size`` only tiled Apex's CUDA
launches and is ignored. Arithmetic is in FP32, as in Apex's kernels, and
the results are written in each output's own dtype. ``noop_flag`` (an int
tensor) is set to 1 where Apex's kernel sets it, without a host sync.

Apex's fused optimizer kernels (``multi_tensor_adam`` ...) are not provided:
asking for one raises an ``AttributeError`` that names what to use instead.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor
f32 = torch.float32

__all__ = ["multi_tensor_l2norm", "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_unscale_l2norm"]


def _raise_flag(noop_flag: Tensor, bad: Tensor) -> None:
    """Set ``noop_flag`` to 1 where the 0-d bool ``bad`` is True (no host sync)."""
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def _flag_non_finite(noop_flag: Tensor, tensors: Sequence[Tensor]) -> None:
    """Set ``noop_flag`` to 1 if any of ``tensors`` holds an inf or a NaN."""
    # an inf-norm is inf or NaN exactly when the tensor holds one
    peaks = torch.stack(torch._foreach_norm(list(tensors), float("inf"), dtype=f32))
    _raise_flag(noop_flag, torch.isfinite(peaks).all().logical_not())


def _l2norm(noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], per_tensor: bool,
            inv_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``multi_tensor_l2norm``'s result, times ``inv_scale`` when given; raises
    ``noop_flag`` when the total is not finite."""
    each = torch.stack(torch._foreach_norm(list(tensor_lists[0]), 2, dtype=f32))
    total = torch.linalg.vector_norm(each).reshape(1)
    if inv_scale is not None:
        inv = inv_scale.to(f32).abs().reshape(())
        total, each = total * inv, each * inv
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

    Args:
        chunk_size: ignored (Apex's CUDA tiling).
        noop_flag: an int tensor of one element.
        tensor_lists: ``[tensors]``.
        inv_scale: a one-element FP32 tensor (1 / loss scale).
        per_tensor: also return each tensor's norm.

    Returns:
        ``(total, per_tensor_norms)``, as ``multi_tensor_l2norm``.

    Example::

        total, _ = amp_C.multi_tensor_unscale_l2norm(2048 * 32, flag, [grads], 1 / scaler.get_scale(), False)
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


#: Apex kernels this module does not provide -> what to use instead
_INSTEAD = {
    "multi_tensor_adam": "apex.optimizers.FusedAdam (amp_patch.apex.optimizers), or torch.optim.AdamW(fused=True)",
    "multi_tensor_adam_capturable": "apex.optimizers.FusedAdam(capturable=True), or torch.optim.AdamW(fused=True)",
    "multi_tensor_adam_capturable_master": "apex.optimizers.FusedAdam(capturable=True, master_weights=True)",
    "multi_tensor_sgd": "apex.optimizers.FusedSGD, or torch.optim.SGD(foreach=True)",
    "multi_tensor_adagrad": "apex.optimizers.FusedAdagrad, or torch.optim.Adagrad(foreach=True)",
    "multi_tensor_lamb": "apex.optimizers.FusedLAMB (amp_patch.apex.optimizers)",
    "multi_tensor_lamb_mp": "apex.optimizers.FusedMixedPrecisionLamb (amp_patch.apex.optimizers)",
    "multi_tensor_novograd": "apex.optimizers.FusedNovoGrad (amp_patch.apex.optimizers)",
    "multi_tensor_l2norm_mp": "amp_C.multi_tensor_l2norm, or torch._foreach_norm(tensors, dtype=torch.float32)",
    "multi_tensor_l2norm_scale": "amp_C.multi_tensor_scale followed by amp_C.multi_tensor_l2norm",
}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    instead = _INSTEAD.get(name, "the torch._foreach_* ops (torch._foreach_mul_, torch._foreach_norm, ...)")
    raise AttributeError(
        f"amp_C.{name} is not provided: amp_patch's amp_C (a stand-in for Apex's) has only "
        f"{', '.join(__all__)}. Use {instead}."
    )
