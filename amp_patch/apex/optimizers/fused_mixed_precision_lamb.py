"""``apex.optimizers.fused_mixed_precision_lamb``: ``FusedMixedPrecisionLamb``, which scripts import from ``apex.optimizers`` or
by this path (``import apex.optimizers.fused_mixed_precision_lamb as m``)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .common import Closure, Params, f32, _closure, _scaling
from .fused_lamb import _Lamb


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
