"""What the ``apex.optimizers`` stand-ins share: the step plumbing (gradients present,
FP32 work copies and their write-back, the loss-scale arguments of Apex's
``step``), Adam's direction, and ``_Fused``, their base class. ``amp_C`` runs the
same multi-tensor code (``adam_direction``, ``copy_back``, ``as_fp32``)."""
from __future__ import annotations

import types
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.amp.grad_scaler import OptState

from ...patching.cast import CASTABLE, LOW

Tensor = torch.Tensor
f32 = torch.float32
Params = Union[Iterable[Tensor], Iterable[Dict[str, Any]]]
Closure = Optional[Callable[[], Any]]

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


def as_fp32(tensors: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """What to compute in: each FP32 tensor (or None) itself, an FP32 copy of each half one."""
    return [t.float() if t is not None and t.dtype in LOW else t for t in tensors]


def copy_back(dsts: List[Optional[Tensor]], works: List[Optional[Tensor]]) -> None:
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


def adam_direction(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], *,
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
