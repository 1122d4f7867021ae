"""``apex.optimizers.fused_lamb``: ``FusedLAMB``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_lamb as m``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .common import (
    adam_direction, as_fp32, _bias_corrections, Closure, _closure, copy_back, _Fused, _global_norm,
    Params, Tensor, _with_grads, _work)


# ------------------------------------------------------------------ LAMB


def lamb(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *,
          lr: Union[float, Tensor], beta1: float, beta2: float, eps: float, step: Union[int, Tensor], bias_correction: bool,
          weight_decay: float, grad_averaging: bool, adam_w_mode: bool, clip: Tensor, use_nvlamb: bool) -> None:
    """One LAMB update of FP32 tensors, as Apex's two-stage kernel: the Adam
    direction of the clipped gradients, scaled per tensor by the trust ratio
    ``||p|| / ||update||`` (1 where either norm is 0), applied only to
    decaying parameters unless ``use_nvlamb``."""
    param_norms = torch._foreach_norm(params)
    bias_correction1, bias_correction2 = _bias_corrections(beta1, beta2, step, bias_correction)
    update = adam_direction(params, torch._foreach_div(grads, clip), exp_avgs, exp_avg_sqs, beta1=beta1,
                             beta2=beta2, beta3=1 - beta1 if grad_averaging else 1.0, eps=eps,
                             bias_correction1=bias_correction1, bias_correction2=bias_correction2,
                             weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    if use_nvlamb or weight_decay != 0:
        w, u = torch.stack(param_norms), torch.stack(torch._foreach_norm(update))
        trust = torch.where((w != 0) & (u != 0), w / u, torch.ones_like(w))
        torch._foreach_mul_(update, list(trust.unbind()))
    torch._foreach_mul_(update, lr)
    torch._foreach_sub_(params, update)


class _Lamb(_Fused):
    """The construction and step ``FusedLAMB`` and ``FusedMixedPrecisionLamb`` share."""

    def __init__(self, params: Params, defaults: Dict[str, Any], set_grad_none: bool, amsgrad: bool,
                 adam_w_mode: bool, use_nvlamb: bool):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    def _lamb_step(self, name: str, inv_scale: Optional[Tensor], reduced: Optional[torch.dtype]) -> None:
        """Clip by the global gradient norm (of the true gradients: ``inv_scale``
        is 1 / loss scale, or None) and update every group; parameters of dtype
        ``reduced`` are updated through FP32 masters with FP32 moments."""
        low = () if reduced is None else (reduced,)
        groups = [(group, _with_grads(name, group["params"])) for group in self.param_groups]
        grads = [p.grad for _, params in groups for p in params]
        if not grads:
            norm = torch.zeros((), device=self.param_groups[0]["params"][0].device)
        else:
            norm = _global_norm(grads)
        if inv_scale is not None:
            norm = norm * inv_scale
        max_norm = self.defaults["max_grad_norm"]
        clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))
        for group, params in groups:
            group["step"] = group.get("step", 0) + 1
            if not params:
                continue
            exp_avgs, exp_avg_sqs = self._states(params, ("exp_avg", "exp_avg_sq"), fp32_for=low)
            work = [_work(p, self.state[p], p.dtype in low) for p in params]
            grads = as_fp32([p.grad for p in params])
            if inv_scale is not None:
                grads = torch._foreach_mul(grads, inv_scale)
            work_avgs, work_sqs = as_fp32(exp_avgs), as_fp32(exp_avg_sqs)
            beta1, beta2 = group["betas"]
            lamb(work, grads, work_avgs, work_sqs, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  step=group["step"], bias_correction=group["bias_correction"], weight_decay=group["weight_decay"],
                  grad_averaging=group["grad_averaging"], adam_w_mode=bool(self.adam_w_mode), clip=clip,
                  use_nvlamb=self.use_nvlamb)
            copy_back(params + exp_avgs + exp_avg_sqs, work + work_avgs + work_sqs)


class FusedLAMB(_Lamb):
    """Apex's ``FusedLAMB``: LAMB (layer-wise adaptive moments, for large batches).

    Gradients are first clipped by their global L2 norm over all groups
    (divided by ``norm / max_grad_norm`` when it exceeds ``max_grad_norm``);
    then each parameter takes an Adam step scaled by its trust ratio
    ``||p|| / ||update||``. Param groups hold ``lr``, ``bias_correction``,
    ``betas``, ``eps``, ``weight_decay``, ``grad_averaging``, ``max_grad_norm``
    and ``step``; the state, ``exp_avg`` and ``exp_avg_sq``. Gradients are left
    untouched (Apex's kernel overwrote them with the update).

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta**step``.
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: the decay factor.
        amsgrad: refused, as Apex refuses it.
        adam_w_mode: decoupled weight decay (True) or L2 on the gradient.
        grad_averaging: scale the gradient by ``1 - beta1`` in the first moment.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        max_grad_norm: the global gradient norm to clip to (the constructor's value, for all groups).
        use_nvlamb: apply the trust ratio to parameters without weight decay too.

    Example::

        from apex.optimizers import FusedLAMB
        opt = FusedLAMB(model.parameters(), lr=1e-3, weight_decay=0.01)
        loss_fn(model(x), y).backward()
        opt.step()
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         use_nvlamb=use_nvlamb)

    @torch.no_grad()
    def step(self, closure: Closure = None) -> Any:
        """One LAMB step over every parameter with a gradient; returns the closure's loss, or None."""
        loss = _closure(closure)
        self._lamb_step("FusedLAMB", None, None)
        return loss
