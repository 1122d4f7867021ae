"""``apex.contrib.optimizers.fused_adam``: Apex's first ``FusedAdam``, always
on its pre-2020 kernel (``fused_adam_cuda.adam``), with its keywords and its
``step(grads=, output_params=, scale=, grad_norms=)``."""
from __future__ import annotations

from typing import Tuple

from ...optimizers import FusedAdam as _FusedAdam
from ...optimizers.common import Params

__all__ = ["FusedAdam"]


class FusedAdam(_FusedAdam):
    """Apex's contrib ``FusedAdam(params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.,
    max_grad_norm=0., amsgrad=False, use_mt=False, amp_scale_adjustment=1.0)``:
    ``apex.optimizers.FusedAdam`` in its first form (see its ``step``).

    Example::

        from apex.contrib.optimizers import FusedAdam, FP16_Optimizer
        opt = FP16_Optimizer(FusedAdam(model.half().parameters(), lr=1e-3, max_grad_norm=1.0),
                             dynamic_loss_scale=True)
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, amsgrad: bool = False, use_mt: bool = False,
                 amp_scale_adjustment: float = 1.0):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, set_grad_none=False,
                         eps_inside_sqrt=eps_inside_sqrt, max_grad_norm=max_grad_norm, use_mt=use_mt,
                         amp_scale_adjustment=amp_scale_adjustment)
