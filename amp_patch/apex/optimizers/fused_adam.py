"""``apex.optimizers.fused_adam``: ``FusedAdam``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_adam as m``)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.optim.adam import adam as _torch_adam

from ...patching.cast import LOW
from ..fused_adam_cuda import adam_foreach as _legacy_adam
from .common import (
    adam_direction, as_fp32, Closure, _closure, copy_back, f32, _Fused, _FUSED_DEVICES, _global_norm,
    Params, _per_group, _scaling, Tensor, _unscaled, _with_grads, _work)


# ------------------------------------------------------------------ Adam


class FusedAdam(_Fused):
    """Apex's ``FusedAdam``: Adam, or AdamW (decoupled weight decay, the default).

    A drop-in for ``torch.optim.AdamW``, or ``torch.optim.Adam`` with
    ``adam_w_mode=False``. Param groups hold Apex's keys (``lr``,
    ``bias_correction``, ``betas``, ``eps``, ``weight_decay``, and ``step``,
    one count per group); the state holds FP32 ``exp_avg`` and ``exp_avg_sq``
    per parameter.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta**step``.
        betas: the moments' decay rates.
        eps: added to the denominator.
        adam_w_mode: True for decoupled weight decay (AdamW), False to add
            ``weight_decay * p`` to the gradient (Adam's L2).
        weight_decay: the decay factor.
        amsgrad: refused, as Apex refuses it.
        set_grad_none: ``zero_grad()`` sets gradients to None (else zeroes them).
        capturable: ``lr`` and ``step`` are tensors on the parameters' device and
            the step takes ``torch.amp.GradScaler``'s scale and overflow flag
            on the device (``scaler.step(optimizer)`` passes itself as
            ``grad_scaler``): a skipped step is not counted.
        master_weights: keep an FP32 master of each half parameter (in its
            state, as ``master_param``) and update through it; needs ``capturable``.
        eps_inside_sqrt, max_grad_norm, use_mt, amp_scale_adjustment: the
            keywords of Apex's first ``FusedAdam`` (before 2020). Giving any of
            them selects that optimizer: its kernel (``fused_adam_cuda.adam``:
            ``p -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * (m / (sqrt(v) + eps)
            + weight_decay * p)``, ``eps`` under the root with
            ``eps_inside_sqrt``), a ``step`` count per parameter, and a global
            clip to ``max_grad_norm`` (each group's ``grad_norm`` over the loss
            scale). ``use_mt`` and ``amp_scale_adjustment`` are accepted and kept.

    Old ``step`` form: ``step(grads=, output_params=, scale=, grad_norms=)``
    (what Apex's fused-era ``FP16_Optimizer`` calls) also runs that kernel:
    the gradients ``grads`` (one list per group, or one list) divided by
    ``scale``, the updated parameters also written into ``output_params``
    (the FP16 model weights), and the clip computed from ``grad_norms``.

    Raises:
        RuntimeError: for ``amsgrad=True``, ``master_weights`` without
            ``capturable``, a sparse gradient or a parameter that is not
            FP16, BF16 or FP32, as Apex does.

    Example::

        from apex.optimizers import FusedAdam
        opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        model, opt = amp.initialize(model, opt, opt_level="O2")
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *, eps_inside_sqrt: Optional[bool] = None,
                 max_grad_norm: Optional[float] = None, use_mt: Optional[bool] = None,
                 amp_scale_adjustment: Optional[float] = None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        legacy = any(a is not None for a in (eps_inside_sqrt, max_grad_norm, use_mt, amp_scale_adjustment))
        if legacy and (capturable or master_weights):
            raise ValueError("FusedAdam: eps_inside_sqrt, max_grad_norm, use_mt and amp_scale_adjustment select "
                             "Apex's first FusedAdam, which has no capturable or master_weights; pass one kind")
        self.capturable = capturable
        defaults = dict(lr=torch.tensor(lr, dtype=f32) if capturable else lr, bias_correction=bias_correction,
                        betas=betas, eps=eps, weight_decay=weight_decay)
        if legacy:
            defaults["max_grad_norm"] = 0.0 if max_grad_norm is None else max_grad_norm
        super().__init__(params, defaults, set_grad_none)
        #: Apex's first FusedAdam: its kernel, its per-parameter step count, its clipping
        self.legacy = legacy
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self._use_multi_tensor = bool(use_mt)
        self._amp_scale_adjustment = 1.0 if amp_scale_adjustment is None else amp_scale_adjustment
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = master_weights
        if capturable:
            self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if self.capturable and group["params"]:
            # each group its own lr tensor, on its parameters' device
            group["lr"] = torch.as_tensor(group["lr"], dtype=f32, device=group["params"][0].device).clone()

    @torch.no_grad()
    def step(self, closure: Closure = None, grads: Optional[Iterable[object]] = None,
             output_params: Optional[Iterable[object]] = None, scale: Optional[float] = None,
             grad_norms: Optional[Iterable[Union[float, Tensor, None]]] = None,
             grad_scaler: Optional[torch.amp.GradScaler] = None) -> Any:
        """One Adam step over every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.
            grads, output_params, scale, grad_norms: the arguments of Apex's
                first ``FusedAdam.step`` (see the class): the gradients to
                use instead of ``p.grad``, tensors to receive a copy of the
                updated parameters, what the gradients are divided by, and
                each group's gradient norm (times ``scale``) for clipping.
            grad_scaler: the ``torch.amp.GradScaler`` stepping this optimizer
                (``capturable=True``; passed by ``scaler.step``).

        Returns:
            The closure's loss, or None.
        """
        if self.legacy or any(a is not None for a in (grads, output_params, scale, grad_norms)):
            if self.capturable:
                raise RuntimeError("FusedAdam(capturable=True).step takes no grads, output_params, scale or "
                                   "grad_norms; those belong to Apex's first FusedAdam")
            loss = _closure(closure)
            self._legacy_step(grads, output_params, 1.0 if scale is None else scale, grad_norms)
            return loss
        loss = _closure(closure)
        found, grad_scale = _scaling(self, grad_scaler) if self.capturable else ({}, None)
        for group in self.param_groups:
            if not group["params"]:
                continue
            device = group["params"][0].device
            found_inf = found.get(device)
            if found_inf is not None:
                found_inf = found_inf.to(f32).reshape(())
            if self.capturable:
                step = group.get("step")
                if step is None:
                    step = group["step"] = torch.zeros(1, dtype=torch.int32, device=device)
                step += 1 if found_inf is None else (found_inf == 0).to(torch.int32)
            else:
                group["step"] = group.get("step", 0) + 1
            params = _with_grads("FusedAdam", group["params"])
            if not params:
                continue
            exp_avgs, exp_avg_sqs = self._states(params, ("exp_avg", "exp_avg_sq"), fp32_for=LOW)
            work = [_work(p, self.state[p], self.master_weights and p.dtype in LOW) for p in params]
            self._update(group, work, as_fp32([p.grad for p in params]), exp_avgs, exp_avg_sqs, found_inf, grad_scale)
            copy_back(params, work)
        return loss

    def _legacy_step(self, grads: Optional[Iterable[object]], output_params: Optional[Iterable[object]], scale: float,
                     grad_norms: Optional[Iterable[Union[float, Tensor, None]]]) -> None:
        """Apex's first ``FusedAdam.step``: its kernel (``fused_adam_cuda.adam``) per
        parameter, each with its own step count, the gradients divided by
        ``scale`` times the clipping factor."""
        n = len(self.param_groups)
        grads_groups, outputs_groups = _per_group(grads, n), _per_group(output_params, n)
        norms = [None] * n if grad_norms is None else list(grad_norms)
        for group, grads_g, outs_g, norm in zip(self.param_groups, grads_groups, outputs_groups, norms):
            params = group["params"]
            grads_g = [None] * len(params) if grads_g is None else list(grads_g)
            outs_g = [None] * len(params) if outs_g is None else list(outs_g)
            if len(grads_g) != len(params) or len(outs_g) != len(params):
                raise ValueError(f"FusedAdam.step: a group of {len(params)} parameters got {len(grads_g)} grads "
                                 f"and {len(outs_g)} output_params; pass one per parameter, group by group")
            chosen = [(p, g if g is not None else p.grad, o) for p, g, o in zip(params, grads_g, outs_g)
                      if g is not None or p.grad is not None]
            if not chosen:
                continue
            for _, g, _ in chosen:
                if g.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients, please consider SparseAdam instead")
            combined_scale = scale
            max_norm = group.setdefault("max_grad_norm", 0.0)
            if max_norm > 0:
                if norm is None:  # Apex needed the caller's norm; without one, the gradients' own
                    norm = _global_norm([g for _, g, _ in chosen])
                clip = ((norm / scale) + 1e-6) / max_norm
                if clip > 1:
                    combined_scale = clip * scale
            by_step: Dict[int, List[Tuple[Tensor, Tensor, Optional[Tensor]]]] = {}
            for p, g, o in chosen:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append((p, g, o))
            beta1, beta2 = group["betas"]
            for step, items in by_step.items():
                ps = [p for p, _, _ in items]
                outs = [o for _, _, o in items]
                if any(o is None for o in outs) and any(o is not None for o in outs):
                    for item in items:  # some parameters with an output copy, some without: one at a time
                        self._legacy_kernel(group, [item[0]], [item[2]] if item[2] is not None else [], [item[1]],
                                            float(combined_scale), step, beta1, beta2)
                    continue
                self._legacy_kernel(group, ps, [o for o in outs if o is not None], [g for _, g, _ in items],
                                    float(combined_scale), step, beta1, beta2)

    def _legacy_kernel(self, group: Dict[str, Any], params: List[Tensor], outs: List[Tensor], grads: List[Tensor],
                       scale: float, step: int, beta1: float, beta2: float) -> None:
        _legacy_adam(params, outs, [self.state[p]["exp_avg"] for p in params],
                     [self.state[p]["exp_avg_sq"] for p in params], grads, group["lr"], beta1, beta2, group["eps"],
                     scale, step, self.eps_mode, 1 if group["bias_correction"] else 0, group["weight_decay"])

    def _update(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                exp_avg_sqs: List[Tensor], found_inf: Optional[Tensor], scale: Optional[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        fused = all(p.device.type in _FUSED_DEVICES for p in params)
        if not fused or not group["bias_correction"]:
            grads = _unscaled(grads, found_inf, scale)
            if grads is None:
                return
            found_inf = scale = None
        if not group["bias_correction"]:  # torch's Adam always corrects the bias
            update = adam_direction(params, grads, exp_avgs, exp_avg_sqs, beta1=beta1, beta2=beta2, beta3=1 - beta1,
                                     eps=group["eps"], bias_correction1=1.0, bias_correction2=1.0,
                                     weight_decay=group["weight_decay"], adam_w_mode=bool(self.adam_w_mode))
            torch._foreach_mul_(update, group["lr"])
            torch._foreach_sub_(params, update)
            return
        step = group["step"]
        device = params[0].device
        # one separate step tensor per parameter, holding step - 1: torch's Adam adds one to each
        if isinstance(step, Tensor):
            steps = (step.to(device, f32).reshape(()) - 1).repeat(len(params))
        else:
            steps = torch.full((len(params),), step - 1.0, device=device)
        _torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], list(steps.unbind()), foreach=not fused, fused=fused,
                    grad_scale=scale, found_inf=found_inf, decoupled_weight_decay=bool(self.adam_w_mode),
                    amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"] if fused else float(group["lr"]),
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
