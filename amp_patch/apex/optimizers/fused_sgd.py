"""``apex.optimizers.fused_sgd``: ``FusedSGD``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_sgd as m``)."""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch.optim.optimizer import required
from torch.optim.sgd import sgd as _torch_sgd

from .common import Closure, Params, _Fused, _closure, copy_back, as_fp32, _with_grads


# ------------------------------------------------------------------ SGD


def sgd_defaults(lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool) -> Dict[str, Any]:
    """The param-group defaults of Apex's SGDs (``FusedSGD``, contrib's ``FusedSGD``),
    checked as Apex (and ``torch.optim.SGD``) checked them.

    Raises:
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay``, or ``nesterov``
            without momentum or with dampening.
    """
    if lr is not required and lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)


class FusedSGD(_Fused):
    """Apex's ``FusedSGD``: SGD with momentum, dampening, Nesterov and weight
    decay, as ``torch.optim.SGD``, plus ``wd_after_momentum``.

    Param groups hold ``lr``, ``momentum``, ``dampening``, ``weight_decay`` and
    ``nesterov``; the state, ``momentum_buffer`` (started at the first
    gradient, as torch's).

    Args:
        params: parameters or param-group dicts.
        lr: learning rate (required).
        momentum: momentum factor.
        dampening: dampening of the momentum.
        weight_decay: the decay factor (L2).
        nesterov: Nesterov momentum (needs momentum and no dampening).
        wd_after_momentum: add ``weight_decay * p`` to the step after the
            momentum instead of to the gradient before it.
        materialize_master_grads: accepted and kept for Apex's signature; it
            tuned Apex's own O2 path, which amp_patch replaces.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).

    Raises:
        ValueError: for a negative ``lr``, ``momentum`` or ``weight_decay``, and
            ``nesterov`` without momentum or with dampening, as Apex does.

    Example::

        from apex.optimizers import FusedSGD
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(self, params: Params, lr: float = required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False):
        super().__init__(params, sgd_defaults(lr, momentum, dampening, weight_decay, nesterov), set_grad_none)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One SGD step over every parameter with a gradient; returns the closure's loss, or None."""
        loss = _closure(closure)
        for group in self.param_groups:
            params = _with_grads("FusedSGD", group["params"], hint="")
            if not params:
                continue
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            bufs = [self.state[p].get("momentum_buffer") for p in params]
            work = as_fp32(params)
            work_bufs = as_fp32(bufs)
            if decay != 0 and self.wd_after_momentum:
                # p -= lr * (d + decay * p), d the momentum step of the bare gradient:
                # this decay, then the decay-free step
                torch._foreach_mul_(work, 1 - lr * decay)
                decay = 0
            _torch_sgd(work, as_fp32([p.grad for p in params]), work_bufs, foreach=True, weight_decay=decay,
                       momentum=momentum, lr=lr, dampening=group["dampening"], nesterov=group["nesterov"],
                       maximize=False)
            if momentum != 0:
                for p, old, new in zip(params, bufs, work_bufs):
                    if old is None:  # torch's SGD made it from the first gradient
                        self.state[p]["momentum_buffer"] = new.to(p.dtype)
            copy_back(params + bufs, work + work_bufs)
        return loss
