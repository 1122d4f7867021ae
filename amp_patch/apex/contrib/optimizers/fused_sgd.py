"""``apex.contrib.optimizers.fused_sgd``: Apex's contrib ``FusedSGD``, the SGD
that only runs wrapped by ``apex.contrib.optimizers.FP16_Optimizer``: its
``step(grads=, output_params=, scale=)`` takes the FP16 gradients, updates the
FP32 masters of its param groups with ``amp_C.multi_tensor_sgd`` (gradients
times ``1 / scale``) and writes the FP16 model weights, as Apex's did."""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch
from torch.optim.optimizer import required

from ... import amp_C
from ...optimizers.common import Closure, Params, _per_group
from ...optimizers.fused_sgd import sgd_defaults

__all__ = ["FusedSGD"]


class FusedSGD(torch.optim.Optimizer):
    """Apex's contrib ``FusedSGD(params, lr, momentum=0, dampening=0,
    weight_decay=0, nesterov=False, wd_after_momentum=False,
    materialize_master_grads=True)``.

    Raises:
        ValueError: for a negative ``lr``, ``momentum`` or ``weight_decay``, or
            ``nesterov`` without momentum or with dampening, as Apex.
        RuntimeError: from ``step`` without ``grads`` and ``output_params``
            (it must be wrapped by the contrib ``FP16_Optimizer``), as Apex.

    Example::

        from apex.contrib.optimizers import FP16_Optimizer, FusedSGD
        opt = FP16_Optimizer(FusedSGD(model.half().parameters(), lr=0.1, momentum=0.9), static_loss_scale=128.0)
        opt.backward(loss)
        opt.step()
    """

    def __init__(self, params: Params, lr: float = required, momentum: float = 0, dampening: float = 0,
                 weight_decay: float = 0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True):
        super().__init__(params, sgd_defaults(lr, momentum, dampening, weight_decay, nesterov))
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int)

    def _momentums(self, params: List[torch.Tensor]) -> Tuple[List[torch.Tensor], bool]:
        """Each parameter's momentum buffer (made as zeros on first use), and whether this is the first run."""
        first = False
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                first = True
        return [self.state[p]["momentum_buffer"] for p in params], first

    @torch.no_grad()
    def step(self, closure: Closure = None, grads: Optional[Iterable[object]] = None,
             output_params: Optional[Iterable[object]] = None, scale: float = 1.0, grad_norms: object = None) -> Any:
        """One SGD step of the FP32 masters from ``grads`` (divided by ``scale``), written into ``output_params``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grads is None or output_params is None:
            raise RuntimeError("apex.contrib.optimizers.FusedSGD must be wrapped with "
                               "apex.contrib.optimizers.FP16_Optimizer which provides grads and output_params.")
        n = len(self.param_groups)
        for group, grads_g, outs_g in zip(self.param_groups, _per_group(grads, n), _per_group(output_params, n)):
            if grads_g is None or outs_g is None:
                raise RuntimeError("apex.contrib.optimizers.FusedSGD only works when all parameters require grad.")
            grads_g, outs_g = list(grads_g), list(outs_g)
            for half in (True, False):  # Apex's two launches: FP16 model weights with a copy, FP32 without
                picked = [(g, m, o) for g, m, o in zip(grads_g, group["params"], outs_g)
                          if (o.dtype == torch.float16) == half]
                if not picked:
                    continue
                masters = [m for _, m, _ in picked]
                bufs, first = self._momentums(masters)
                lists = [[g for g, _, _ in picked], masters, bufs] + ([[o for _, _, o in picked]] if half else [])
                amp_C.multi_tensor_sgd(2048 * 32, self._dummy_overflow_buf, lists, group["weight_decay"],
                                       group["momentum"], group["dampening"], group["lr"], group["nesterov"], first,
                                       self.wd_after_momentum, 1.0 / scale)
        return loss
