"""``apex.optimizers.fused_novograd``: ``FusedNovoGrad``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_novograd as m``)."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch

from ...patching.cast import LOW
from .common import (
    as_fp32, _bias_corrections, Closure, _closure, copy_back, f32, _Fused, Params, Tensor, _with_grads)


# ------------------------------------------------------------------ NovoGrad


def _novograd(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], norms: Tensor, *, lr: float,
              beta1: float, beta2: float, eps: float, step: int, bias_correction: bool, weight_decay: float,
              grad_averaging: bool, reg_inside_moment: bool, norm_type: int, start: bool) -> None:
    """One NovoGrad update of FP32 tensors, as Apex's kernel: ``norms`` (one
    per tensor, a norm, not its square) blends in this step's gradient norms,
    then serves as each tensor's second moment. ``start``: first set
    ``norms`` to this step's norms, so the first blend keeps them."""
    new = torch.stack(torch._foreach_norm(grads, 2 if norm_type == 2 else float("inf"), dtype=f32))
    if start:
        norms.copy_(new)
    if norm_type == 2:
        norms.copy_((beta2 * norms * norms + (1 - beta2) * new * new).sqrt())
    else:
        norms.mul_(beta2).add_(new, alpha=1 - beta2)
    bias_correction1, bias_correction2 = _bias_corrections(beta1, beta2, step, bias_correction)
    bias_correction2 = bias_correction2 ** 0.5
    denoms = list((norms / bias_correction2 + eps).unbind())
    beta3 = 1 - beta1 if grad_averaging else 1.0
    if reg_inside_moment:  # the paper's form: normalise and decay inside the moment
        g = torch._foreach_div(grads, denoms)
        if weight_decay != 0:
            torch._foreach_add_(g, params, alpha=weight_decay)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, g, alpha=beta3)
        torch._foreach_add_(params, exp_avgs, alpha=-lr / bias_correction1)
        return
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=beta3)
    update = torch._foreach_div(exp_avgs, bias_correction1)
    torch._foreach_div_(update, denoms)
    if weight_decay != 0:
        torch._foreach_add_(update, params, alpha=weight_decay)
    torch._foreach_add_(params, update, alpha=-lr)


class FusedNovoGrad(_Fused):
    """Apex's ``FusedNovoGrad``: NovoGrad, Adam with a per-layer second moment.

    Each parameter's second moment is one number, a running blend of its
    gradient's norm (L2: ``sqrt(beta2 * v**2 + (1 - beta2) * ||g||**2)``;
    inf: ``beta2 * v + (1 - beta2) * max|g|``). As in Apex these live in the
    param group, ``group["exp_avg_sq"] = [norms of the half parameters, norms
    of the FP32 ones]`` (in parameter order), so the parameters with a
    gradient must be the same at every step. Param groups also hold ``lr``,
    ``bias_correction``, ``betas``, ``eps``, ``weight_decay``,
    ``grad_averaging``, ``norm_type``, ``init_zero`` and ``step``; the state,
    ``exp_avg``.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by their bias corrections.
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: the decay factor.
        amsgrad: refused, as Apex refuses it.
        reg_inside_moment: normalise the gradient and add the decay inside the
            first moment (the paper's form) instead of in the step.
        grad_averaging: scale the gradient by ``1 - beta1`` in the first moment.
        norm_type: 2 for the L2 norm, 0 for the inf norm.
        init_zero: start the second moments at 0 instead of at the first
            step's norms.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).

    Raises:
        RuntimeError: for ``amsgrad=True``, a ``norm_type`` other than 0 or 2, or a
            sparse gradient, as Apex does.

    Example::

        from apex.optimizers import FusedNovoGrad
        opt = FusedNovoGrad(model.parameters(), lr=1e-2, betas=(0.95, 0.98), weight_decay=1e-3)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One NovoGrad step over every parameter with a gradient; returns the closure's loss, or None."""
        loss = _closure(closure)
        for g, group in enumerate(self.param_groups):
            group["step"] = group.get("step", 0) + 1
            params = _with_grads("FusedNovoGrad", group["params"])
            if group["norm_type"] not in (0, 2):
                raise RuntimeError("FusedNovoGrad only support l2/inf norm now.")
            kinds = ([p for p in params if p.dtype in LOW], [p for p in params if p.dtype not in LOW])
            device = group["params"][0].device if group["params"] else None
            first = "exp_avg_sq" not in group
            if first:
                group["exp_avg_sq"] = [torch.zeros(len(ps), dtype=f32, device=device) for ps in kinds]
            for ps, norms, what in zip(kinds, group["exp_avg_sq"], ("half", "FP32")):
                if len(ps) != norms.numel():
                    raise RuntimeError(
                        f"FusedNovoGrad: param_groups[{g}] holds {norms.numel()} {what} gradient norms "
                        f"(exp_avg_sq), but {len(ps)} {what} parameters have a gradient now; as in Apex, the "
                        f"parameters with a gradient must be the same at every step"
                    )
                if not ps:
                    continue
                exp_avgs, = self._states(ps, ("exp_avg",))
                work, work_avgs = as_fp32(ps), as_fp32(exp_avgs)
                beta1, beta2 = group["betas"]
                _novograd(work, as_fp32([p.grad for p in ps]), work_avgs, norms, lr=group["lr"], beta1=beta1,
                          beta2=beta2, eps=group["eps"], step=group["step"], bias_correction=group["bias_correction"],
                          weight_decay=group["weight_decay"], grad_averaging=group["grad_averaging"],
                          reg_inside_moment=self.moment_mode == 0, norm_type=group["norm_type"],
                          start=first and not group["init_zero"])
                copy_back(ps + exp_avgs, work + work_avgs)
        return loss
