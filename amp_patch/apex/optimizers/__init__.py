"""Stand-in for ``apex.optimizers``: ``FusedAdam``, ``FusedAdagrad``,
``FusedSGD``, ``FusedLAMB``, ``FusedNovoGrad`` and ``FusedMixedPrecisionLamb``,
with Apex's constructor arguments and defaults, its param-group keys and its
state layout (so Apex checkpoints load), on any device.

Kernels: Adam (with bias correction), SGD and Adagrad run torch's own update,
``torch.optim.adam.adam`` (its fused kernel on CPU and CUDA) and
``torch.optim.sgd.sgd`` / ``torch.optim.adagrad.adagrad`` with
``foreach=True``; Apex's decoupled weight decay variants of SGD and Adagrad
are one multi-tensor multiply before them. LAMB, NovoGrad and Adam without
bias correction, which torch lacks, are written here once each on
``torch._foreach_*`` ops, following Apex's kernels.

Half (FP16/BF16) parameters are updated as Apex's kernels update them: the
arithmetic in FP32, rounded once into the parameter. Their state keeps Apex's
dtypes (FP32 moments for Adam, the parameter's dtype for the others), and
``load_state_dict`` keeps each state tensor's saved dtype where torch would
cast it to the parameter's.

They are ordinary ``torch.optim.Optimizer`` subclasses: amp_patch's O2/O5
hands them FP32 master weights like any optimizer, and ``zero_grad()``
follows each one's ``set_grad_none``.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.amp.grad_scaler import OptState
from torch.optim.adagrad import adagrad as _torch_adagrad
from torch.optim.adam import adam as _torch_adam
from torch.optim.optimizer import required
from torch.optim.sgd import sgd as _torch_sgd

from ...patching.cast import CASTABLE, LOW
from .._submodules import submodule_getattr
from ..fused_adam_cuda import adam_foreach as _legacy_adam
from .fp16_optimizer import FP16_Optimizer

Tensor = torch.Tensor
f32 = torch.float32
Params = Union[Iterable[Tensor], Iterable[Dict[str, Any]]]
Closure = Optional[Callable[[], Any]]

__all__ = ["FusedAdam", "FusedAdagrad", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedMixedPrecisionLamb",
           "FP16_Optimizer"]

#: devices where torch has a fused Adam kernel, which also unscales and skips on overflow
_FUSED_DEVICES = ("cpu", "cuda")


# ------------------------------------------------------------------ shared plumbing


def _closure(closure: Closure) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(name: str, params: List[Tensor], hint: str = ", please consider SparseAdam instead") -> List[Tensor]:
    """The parameters of ``params`` that have a gradient, refusing what Apex's kernels refuse."""
    out = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{name} does not support sparse gradients{hint}")
        if p.dtype not in CASTABLE:
            raise RuntimeError(f"{name} only support fp16 and fp32.")
        out.append(p)
    return out


def _fp32(tensors: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """What to compute in: each FP32 tensor (or None) itself, an FP32 copy of each half one."""
    return [t.float() if t is not None and t.dtype in LOW else t for t in tensors]


def _copy_back(dsts: List[Optional[Tensor]], works: List[Optional[Tensor]]) -> None:
    """Round each FP32 working copy into the tensor it was made from (one multi-tensor copy)."""
    pairs = [(d, w) for d, w in zip(dsts, works) if d is not w and d is not None]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [w for _, w in pairs])


def _work(p: Tensor, state: Dict[str, Any], master: bool) -> Tensor:
    """The FP32 tensor ``p`` is updated through: its FP32 master (kept in
    ``state``, made on first use), else an FP32 copy if ``p`` is half, else ``p``."""
    if master:
        if "master_param" not in state:
            state["master_param"] = p.detach().float()
        return state["master_param"]
    return p.float() if p.dtype in LOW else p


def _scaling(optimizer: torch.optim.Optimizer, grad_scaler: Optional[torch.amp.GradScaler]) -> Tuple[Dict[torch.device, Tensor], Optional[Tensor]]:
    """``({device: found_inf}, scale)`` from the ``torch.amp.GradScaler`` whose
    ``step`` calls this optimizer (Apex's capturable contract: the scaler
    passes itself as ``grad_scaler``); ``({}, None)`` without one.

    ``scale`` is None once ``scaler.unscale_(optimizer)`` ran: the gradients
    are true ones already and must not be unscaled again.
    """
    if grad_scaler is None:
        return {}, None
    state = grad_scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:
        return state["found_inf_per_device"], None
    return grad_scaler._check_inf_per_device(optimizer), grad_scaler._get_scale_async()


def _global_norm(grads: List[Tensor]) -> Tensor:
    """The L2 norm of all ``grads`` together, squares summed in FP32 (0-d)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=f32)))


def _bias_corrections(beta1: float, beta2: float, step: Union[int, Tensor], on: bool) -> Tuple[Union[float, Tensor], Union[float, Tensor]]:
    """Adam's ``(1 - beta1**step, 1 - beta2**step)``, or ``(1, 1)`` when off;
    0-d tensors when ``step`` is a tensor (no host sync)."""
    if not on:
        return 1.0, 1.0
    if isinstance(step, Tensor):
        step = step.to(f32).reshape(())
    return 1 - beta1 ** step, 1 - beta2 ** step


def _adam_direction(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *,
                    beta1: float, beta2: float, beta3: float, eps: float, bias_correction1: Union[float, Tensor],
                    bias_correction2: Union[float, Tensor], weight_decay: float, adam_w_mode: bool) -> List[Tensor]:
    """Apex's Adam update direction (its Adam kernel, and stage 1 of its LAMB
    kernel): moves the moments in place and returns ``m_hat / (sqrt(v_hat) +
    eps)``, plus ``weight_decay * p`` in AdamW mode (in L2 mode the decay is
    added to the gradient instead). ``grads`` are left as they are."""
    if weight_decay != 0 and not adam_w_mode:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=beta3)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_div(exp_avg_sqs, bias_correction2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, bias_correction1)
    torch._foreach_div_(update, denom)
    if weight_decay != 0 and adam_w_mode:
        torch._foreach_add_(update, params, alpha=weight_decay)
    return update


def _unscaled(grads: List[Tensor], found_inf: Optional[Tensor], scale: Optional[Tensor]) -> Optional[List[Tensor]]:
    """The true gradients, or None when the step must be skipped (asks the device: a host sync)."""
    if found_inf is not None and bool(found_inf.any()):
        return None
    if scale is None:
        return grads
    return torch._foreach_div(grads, scale.to(f32).reshape(()))


class _Fused(torch.optim.Optimizer):
    """What Apex's fused optimizers share: ``zero_grad`` following
    ``set_grad_none``, and ``load_state_dict`` keeping state dtypes."""

    def __init__(self, params: Params, defaults: Dict[str, Any], set_grad_none: bool):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Set the gradients to None, or to zero, as ``set_to_none`` says
        (default: the constructor's ``set_grad_none``, as Apex's ``zero_grad()``)."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _states(self, params: List[Tensor], keys: Tuple[str, ...],
                fp32_for: Tuple[torch.dtype, ...] = ()) -> List[List[Tensor]]:
        """The state tensors ``keys`` of ``params``, one list per key. A
        parameter's first step makes them zeros, FP32 for a parameter whose
        dtype is in ``fp32_for``, else in the parameter's dtype."""
        for p in params:
            state = self.state[p]
            if not state:
                dtype = f32 if p.dtype in fp32_for else p.dtype
                for key in keys:
                    state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return [[self.state[p][key] for p in params] for key in keys]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, with each state tensor in
        its saved dtype (torch would cast Apex's FP32 moments of a half
        parameter to half) and group tensors on their parameters' device."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key, value in saved.get(i, {}).items():
                if isinstance(value, Tensor) and value.dtype != self.state[p][key].dtype:
                    self.state[p][key] = value.to(p.device)
        for group in self.param_groups:
            if group["params"]:
                device = group["params"][0].device
                for key, value in group.items():
                    if key != "params":
                        group[key] = _to_device(value, device)


def _to_device(value: object, device: torch.device) -> object:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


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
            self._update(group, work, _fp32([p.grad for p in params]), exp_avgs, exp_avg_sqs, found_inf, grad_scale)
            _copy_back(params, work)
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
            update = _adam_direction(params, grads, exp_avgs, exp_avg_sqs, beta1=beta1, beta2=beta2, beta3=1 - beta1,
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


def _per_group(lists: Optional[Iterable[object]], n_groups: int) -> List[Any]:
    """Apex's reading of the old ``step``'s ``grads`` / ``output_params``: None,
    one list (a single group), or one list per group."""
    if lists is None:
        return [None] * n_groups
    if isinstance(lists, types.GeneratorType):
        return [lists]
    lists = list(lists)
    if lists and not isinstance(lists[0], (list, tuple)):
        return [lists]
    return lists


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
            work, work_sums = _fp32(params), _fp32(sums)
            lr, decay = group["lr"], group["weight_decay"]
            if self.adagrad_w_mode and decay != 0:
                # p -= lr * (g / (sqrt(sum) + eps) + decay * p) is this decay, then the L2-free step
                torch._foreach_mul_(work, 1 - lr * decay)
                decay = 0.0
            # torch's Adagrad counts steps only for its lr_decay, which is 0 here
            steps = list(torch.zeros(len(params)).unbind())
            _torch_adagrad(work, _fp32([p.grad for p in params]), work_sums, steps, foreach=True, lr=lr,
                           weight_decay=decay, lr_decay=0.0, eps=group["eps"], maximize=False)
            _copy_back(params + sums, work + work_sums)
        return loss


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
            work = _fp32(params)
            work_bufs = _fp32(bufs)
            if decay != 0 and self.wd_after_momentum:
                # p -= lr * (d + decay * p), d the momentum step of the bare gradient:
                # this decay, then the decay-free step
                torch._foreach_mul_(work, 1 - lr * decay)
                decay = 0
            _torch_sgd(work, _fp32([p.grad for p in params]), work_bufs, foreach=True, weight_decay=decay,
                       momentum=momentum, lr=lr, dampening=group["dampening"], nesterov=group["nesterov"],
                       maximize=False)
            if momentum != 0:
                for p, old, new in zip(params, bufs, work_bufs):
                    if old is None:  # torch's SGD made it from the first gradient
                        self.state[p]["momentum_buffer"] = new.to(p.dtype)
            _copy_back(params + bufs, work + work_bufs)
        return loss


# ------------------------------------------------------------------ LAMB


def _lamb(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *,
          lr: Union[float, Tensor], beta1: float, beta2: float, eps: float, step: Union[int, Tensor], bias_correction: bool,
          weight_decay: float, grad_averaging: bool, adam_w_mode: bool, clip: Tensor, use_nvlamb: bool) -> None:
    """One LAMB update of FP32 tensors, as Apex's two-stage kernel: the Adam
    direction of the clipped gradients, scaled per tensor by the trust ratio
    ``||p|| / ||update||`` (1 where either norm is 0), applied only to
    decaying parameters unless ``use_nvlamb``."""
    param_norms = torch._foreach_norm(params)
    bias_correction1, bias_correction2 = _bias_corrections(beta1, beta2, step, bias_correction)
    update = _adam_direction(params, torch._foreach_div(grads, clip), exp_avgs, exp_avg_sqs, beta1=beta1,
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
            grads = _fp32([p.grad for p in params])
            if inv_scale is not None:
                grads = torch._foreach_mul(grads, inv_scale)
            work_avgs, work_sqs = _fp32(exp_avgs), _fp32(exp_avg_sqs)
            beta1, beta2 = group["betas"]
            _lamb(work, grads, work_avgs, work_sqs, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  step=group["step"], bias_correction=group["bias_correction"], weight_decay=group["weight_decay"],
                  grad_averaging=group["grad_averaging"], adam_w_mode=bool(self.adam_w_mode), clip=clip,
                  use_nvlamb=self.use_nvlamb)
            _copy_back(params + exp_avgs + exp_avg_sqs, work + work_avgs + work_sqs)


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


class FusedMixedPrecisionLamb(_Lamb):
    """Apex's ``FusedMixedPrecisionLamb``: ``FusedLAMB`` with ``lr`` and ``step``
    as tensors on the parameters' device, FP32 masters for parameters of
    ``reduced_precision_dtype``, and ``torch.amp.GradScaler`` support.

    Inside ``scaler.step(optimizer)`` (the scaler passes itself as
    ``grad_scaler``) the gradients are unscaled before clipping, and a step
    whose gradients overflowed is skipped and not counted. Masters are made
    at the first step (after DDP has synchronised the parameters) and kept
    in the state as ``master_param``, so checkpoints carry them.

    Args:
        params: parameters or param-group dicts; each group of one dtype.
        lr: learning rate.
        step: the step count to start from.
        bias_correction: divide the moments by ``1 - beta**step``.
        betas: the moments' decay rates.
        eps: added to the denominator.
        weight_decay: the decay factor.
        amsgrad: refused, as Apex refuses it.
        adam_w_mode: decoupled weight decay (True) or L2 on the gradient.
        grad_averaging: scale the gradient by ``1 - beta1`` in the first moment.
        max_grad_norm: the global gradient norm to clip to.
        use_nvlamb: apply the trust ratio to parameters without weight decay too.
        reduced_precision_dtype: parameters of this dtype (e.g. ``torch.bfloat16``)
            get FP32 masters and FP32 moments.

    Example::

        from apex.optimizers import FusedMixedPrecisionLamb
        opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-3, reduced_precision_dtype=torch.bfloat16)
        scaler = torch.amp.GradScaler()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    """

    def __init__(self, params: Params, lr: float = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: Optional[torch.dtype] = None):
        defaults = dict(lr=torch.tensor(lr, dtype=f32), step=torch.tensor([step], dtype=torch.int),
                        bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=True, amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                         use_nvlamb=use_nvlamb)
        self.reduced_precision_dtype = reduced_precision_dtype
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else None
        # each group its own lr and step tensors (the defaults are shared objects), on its device
        group["lr"] = torch.as_tensor(group["lr"], dtype=f32, device=device).clone()
        group["step"] = torch.as_tensor(group["step"], dtype=torch.int, device=device).reshape(1).clone()

    @torch.no_grad()
    def step(self, closure: Closure = None, grad_scaler: Optional[torch.amp.GradScaler] = None) -> Any:
        """One LAMB step, skipped when ``grad_scaler`` found an overflow.

        Args:
            closure: re-evaluates the model and returns the loss.
            grad_scaler: the ``torch.amp.GradScaler`` stepping this optimizer
                (passed by ``scaler.step``).

        Returns:
            The closure's loss, or None.
        """
        loss = _closure(closure)
        for group in self.param_groups:
            dtypes = {p.dtype for p in group["params"]}
            if len(dtypes) > 1:
                raise RuntimeError(f"Error: Parameters are not of the identical type: {sorted(map(str, dtypes))}")
        found, scale = _scaling(self, grad_scaler)
        if any(bool(f.any()) for f in found.values()):
            return loss
        inv_scale = None if scale is None else scale.double().reciprocal().float().reshape(())
        self._lamb_step("FusedMixedPrecisionLamb", inv_scale, self.reduced_precision_dtype)
        return loss


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
                work, work_avgs = _fp32(ps), _fp32(exp_avgs)
                beta1, beta2 = group["betas"]
                _novograd(work, _fp32([p.grad for p in ps]), work_avgs, norms, lr=group["lr"], beta1=beta1,
                          beta2=beta2, eps=group["eps"], step=group["step"], bias_correction=group["bias_correction"],
                          weight_decay=group["weight_decay"], grad_averaging=group["grad_averaging"],
                          reg_inside_moment=self.moment_mode == 0, norm_type=group["norm_type"],
                          start=first and not group["init_zero"])
                _copy_back(ps + exp_avgs, work + work_avgs)
        return loss


__getattr__ = submodule_getattr(__name__)  # the submodules (fused_adam, ...), on first use
