"""Leaves a scaled backward reaches that amp_patch does not unscale.

A plain ``loss.backward()`` under FP16 loss scaling runs the backward of
``loss * scale``. Every leaf the graph reaches gets a gradient ``scale`` times
too large; amp_patch unscales the gradients of the parameters its attached
optimizers own at the step. Any other leaf (a second network whose optimizer
was never attached, a teacher that still requires grad, an input with
``requires_grad`` for adversarial training or a saliency map) would keep the
scaled gradient, and whatever reads it (another optimizer's ``step()``,
``x.grad.sign()``) would use a value 65536 times too large.

``foreign_leaves`` walks the autograd graph from the loss to its
``AccumulateGrad`` nodes and returns the leaves no attached optimizer owns;
``unscale_on_arrival`` puts a hook on each that divides its incoming gradient
by the scale before autograd accumulates it, so ``.grad`` of such a leaf holds
exactly what an unscaled backward would have accumulated (the scale is a power
of two, so the division is exact). Where the scaled gradient overflowed, the
attached optimizers skip the step as for an overflow of their own, and the
entries are zeroed in the foreign leaf, whose optimizer amp_patch cannot skip.
The walk costs one visit per graph node; the figures are in
``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List, Sequence

import torch

from ..precision import fsdp

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .state import Handle, LossScaling

Tensor = torch.Tensor

def owned_ids(handles: Iterable["Handle"]) -> set:
    """``id`` of every tensor whose gradient amp_patch unscales for ``handles``:
    the parameters each optimizer steps and, under O2, the half model
    parameters behind its FP32 masters; under FSDP2 (whose optimizer holds the
    sharded DTensors) the unsharded parameters FSDP gathers for the forward,
    which are what a backward reaches."""
    ids = set()
    models: list = []
    sharded = set()
    dtensor = fsdp.dtensor_type()  # None unless torch.distributed.tensor was imported
    for h in handles:
        for group in h.optimizer.param_groups:
            params = group["params"]
            ids.update(map(id, params))
            if dtensor is not None:
                sharded.update(id(p) for p in params if isinstance(p, dtensor))
        mw = h.masters
        if mw is not None:
            ids.update(map(id, mw.halfs))
        if not models:
            models = h.run.hooks.models()
    if sharded:
        ids |= fsdp.unsharded_ids(models, sharded)
    return ids


def graph_leaves(loss: Tensor) -> List[Tensor]:
    """The leaf tensors a backward from ``loss`` accumulates gradients into."""
    root = loss.grad_fn
    if root is None:
        return [loss] if loss.requires_grad else []
    seen = {root}
    stack = [root]
    out = []
    while stack:
        node = stack.pop()
        var = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if var is not None:
            out.append(var)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return out


def split(loss: Tensor, owned: set) -> "tuple[bool, List[Tensor]]":
    """``(reaches_owned, foreign)``: whether the backward reaches a leaf in
    ``owned``, and the leaves it reaches outside it."""
    reaches, foreign = False, []
    for leaf in graph_leaves(loss):
        if id(leaf) in owned:
            reaches = True
        else:
            foreign.append(leaf)
    return reaches, foreign


class _Unscale:
    """Tensor hook: the incoming gradient divided by the loss scale.

    Folds an inf/NaN into the loss's overflow flag on the device (no host
    sync), so the attached optimizers skip the step and the scale backs off,
    as for their own gradients; and zeroes those entries, since the scaled
    value they would have had unscaled is gone and the leaf's own optimizer,
    which amp_patch does not hold, would otherwise step on inf."""

    __slots__ = ("run", "check", "loss_id")

    def __init__(self, run: "LossScaling", check: int, loss_id: int):
        self.run, self.check, self.loss_id = run, check, loss_id

    def __call__(self, grad: Tensor) -> Tensor:
        run, l, dev = self.run, self.loss_id, grad.device
        out = grad.clone()
        torch._amp_foreach_non_finite_check_and_unscale_([out], run.found_flag(self.check, dev), run.inv_scale(l, dev))
        return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)


def unscale_on_arrival(leaves: Sequence[Tensor], run: "LossScaling", loss_id: int) -> List["RemovableHandle"]:
    """Hook each of ``leaves`` so its gradient arrives unscaled, its overflow
    counted against loss ``loss_id`` of ``run`` (the scaling state); returns
    the hook handles, to be removed once the backward is over."""
    check = run.new_check(loss_id)
    run.foreign.setdefault(loss_id, []).append(check)  # the backward's own optimizers skip on it too
    hook = _Unscale(run, check, loss_id)
    return [leaf.register_hook(hook) for leaf in leaves]


def describe(leaves: Sequence[Tensor], limit: int = 3) -> str:
    """A short description of foreign parameters for a warning."""
    shapes = ", ".join(f"{type(t).__name__}{tuple(t.shape)}" for t in leaves[:limit])
    more = f" and {len(leaves) - limit} more" if len(leaves) > limit else ""
    return shapes + more
