"""``apex.optimizers.fused_adagrad``: ``FusedAdagrad``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_adagrad as m``)."""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.adagrad import adagrad as _torch_adagrad

from .common import Closure, Params, _Fused, _closure, copy_back, as_fp32, _with_grads


# ------------------------------------------------------------------ Adagrad


class FusedAdagrad(_Fused):
    """Apex's ``FusedAdagrad``: Adagrad with L2 or decoupled weight decay.

    ``sum += g*g; p -= lr * g / (sqrt(sum) + eps)``, with ``weight_decay * p``
    added to ``g`` first (L2), or to the step (``adagrad_w_mode=True``).
    Param groups hold ``lr``, ``eps`` and ``weight_decay``; the state, ``sum``.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        eps: added to the denominator.
        weight_decay: the decay factor.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        adagrad_w_mode: decoupled weight decay instead of L2.

    Example::

        from apex.optimizers import FusedAdagrad
        opt = FusedAdagrad(model.parameters(), lr=1e-2, weight_decay=1e-4)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(self, params: Params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One Adagrad step over every parameter with a gradient; returns the closure's loss, or None."""
        loss = _closure(closure)
        for group in self.param_groups:
            params = _with_grads("FusedAdagrad", group["params"], hint="")
            if not params:
                continue
            sums, = self._states(params, ("sum",))
            work, work_sums = as_fp32(params), as_fp32(sums)
            lr, decay = group["lr"], group["weight_decay"]
            if self.adagrad_w_mode and decay != 0:
                # p -= lr * (g / (sqrt(sum) + eps) + decay * p) is this decay, then the L2-free step
                torch._foreach_mul_(work, 1 - lr * decay)
                decay = 0.0
            # torch's Adagrad counts steps only for its lr_decay, which is 0 here
            steps = list(torch.zeros(len(params)).unbind())
            _torch_adagrad(work, as_fp32([p.grad for p in params]), work_sums, steps, foreach=True, lr=lr,
                           weight_decay=decay, lr_decay=0.0, eps=group["eps"], maximize=False)
            copy_back(params + sums, work + work_sums)
        return loss
