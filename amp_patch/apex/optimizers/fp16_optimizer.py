"""``apex.optimizers.FP16_Optimizer``: the fused-era wrapper of Apex's first
``FusedAdam`` (2019; moved to ``apex.contrib.optimizers`` later).

Unlike ``apex.fp16_utils.FP16_Optimizer`` it does no arithmetic itself: it
keeps FP32 master weights in the wrapped optimizer's param groups, scales the
loss in ``backward``, and calls the optimizer's old ``step(grads=,
output_params=, scale=, grad_norms=)``, which unscales, clips, updates the
masters and writes the FP16 model weights. Its loss scaling is its own,
Apex's: a dynamic scale starts at ``2**16``, halves (to no less than 1) on an
overflow, which skips the step, and doubles after each 1000 clean steps.

Two layouts, as in Apex: ``FP16_Optimizer`` (``apex.optimizers``) flattens
each group's FP16 weights into one buffer with one FP32 master
(``fp16_groups_flat``, ``fp32_groups_flat``); ``ContribFP16_Optimizer``
(served as ``apex.contrib.optimizers.FP16_Optimizer``) keeps one master per
parameter (``fp32_groups``) and checks overflow as ``amp_C.multi_tensor_l2norm``
does, into ``overflow_buf``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..fp16_utils.fp16_optimizer import ForwardsToOptimizer

log = logging.getLogger("amp_patch")

__all__ = ["FP16_Optimizer", "ContribFP16_Optimizer"]


class FP16_Optimizer(ForwardsToOptimizer):
    """Apex's fused-era ``FP16_Optimizer``: FP32 masters and loss scaling around
    an optimizer with the old ``step(grads=, output_params=, scale=, grad_norms=)``
    (``apex.optimizers.FusedAdam`` given ``max_grad_norm`` or the like, or
    ``apex.contrib.optimizers.FusedAdam``).

    Args:
        init_optimizer: the optimizer over the FP16 model's parameters.
        static_loss_scale: the loss scale when not dynamic.
        dynamic_loss_scale: scale dynamically (start ``2**16``, window 1000).
        dynamic_loss_args: refused, as Apex refused it.
        verbose: report each overflow.

    Raises:
        SystemError: for ``dynamic_loss_args``, as Apex.

    Example::

        from apex.optimizers import FusedAdam, FP16_Optimizer
        model.half()
        optimizer = FusedAdam(model.parameters(), lr=3e-5, bias_correction=False, max_grad_norm=1.0)
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
        loss = model(x).float().pow(2).mean()
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    """

    _flat = True

    def __init__(self, init_optimizer: Any, static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False,
                 dynamic_loss_args: Optional[Dict[str, Any]] = None, verbose: bool = True):
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[torch.Tensor]] = []
        if self._flat:
            self.fp16_groups_flat: List[torch.Tensor] = []
            self.fp32_groups_flat: List[torch.Tensor] = []
        else:
            self.fp32_groups: List[List[torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            fp16 = list(group["params"])
            self.fp16_groups.append(fp16)
            if self._flat:
                flat = _flatten_dense_tensors([p.clone().detach() for p in fp16])
                self.fp16_groups_flat.append(flat)
                self._point_into(fp16, flat)
                master = flat.clone().float().detach()
                master.requires_grad = True  # as Apex kept it, for optimizers that look
                self.fp32_groups_flat.append(master)
                group["params"] = [master]
            else:
                masters = [p.clone().float().detach() for p in fp16]
                self.fp32_groups.append(masters)
                group["params"] = masters
        if not self._flat:
            self.overflow_buf = torch.zeros(1, dtype=torch.int)
        if dynamic_loss_scale:
            if dynamic_loss_args is not None:
                raise SystemError("Do not support dynamic loss scale args for now.")
            self.dynamic_loss_scale = True
            self.cur_scale = 2.0**16
            self.cur_iter = 0
            self.last_overflow_iter = -1
            self.scale_factor = 2
            self.scale_window = 1000
        else:
            self.dynamic_loss_scale = False
            self.cur_iter = 0
            self.cur_scale = static_loss_scale
        self.verbose = verbose

    @staticmethod
    def _point_into(params: List[torch.Tensor], flat: torch.Tensor) -> None:
        """Make each model parameter's data a view of the flat FP16 buffer."""
        for p, q in zip(params, _unflatten_dense_tensors(flat, params)):
            p.data = q.data

    def zero_grad(self, set_grads_to_None: bool = True) -> None:
        """Clear the FP16 parameters' gradients (to None by default, as Apex)."""
        for group in self.fp16_groups:
            for p in group:
                if set_grads_to_None:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss.float() * loss_scale).backward()``: scaled FP16 gradients."""
        (loss.float() * self.cur_scale).backward()

    def _norms(self) -> Tuple[list, list, bool]:
        """``(grads per group, norm per group, overflow)``, as each of Apex's layouts computed them."""
        if self._flat:
            grads = [_flatten_dense_tensors([p.grad for p in group]) for group in self.fp16_groups]
            norms = [float(torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)) for g in grads]
            bad = any(n in (float("inf"), -float("inf")) or n != n for n in norms)
            return [[g] for g in grads], norms, bad
        grads = [[p.grad for p in group] for group in self.fp16_groups]
        self.overflow_buf.zero_()
        norms = []
        for g in grads:
            if g:  # amp_C.multi_tensor_l2norm's total, and its flag
                norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(g, 2, dtype=torch.float32)))
                self.overflow_buf.masked_fill_(~torch.isfinite(norm), 1)
                norms.append(norm.reshape(1))
        return grads, norms, bool(self.overflow_buf.item())

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the gradients about to be applied to a total norm of ``max_norm``
        (``apex.fp16_utils.FP16_Optimizer``'s method, for scripts that call it on
        this one): the FP16 gradients, divided by the loss scale, are measured,
        and scaled down by ``max_norm / (norm + 1e-6)`` when above it.

        Returns:
            The total norm of the unscaled gradients, or -1 on an overflow (the
            gradients are then left as they are; ``step`` will skip).

        Example::

            optimizer.backward(loss)
            optimizer.clip_master_grads(1.0)
            optimizer.step()
        """
        grads = [p.grad for group in self.fp16_groups for p in group if p.grad is not None]
        if not grads:
            return 0.0
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        total = float(torch.linalg.vector_norm(torch.stack(norms), norm_type)) / self.cur_scale
        if total != total or total in (float("inf"), -float("inf")):
            return -1
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            torch._foreach_mul_(grads, coef)
        return total

    def step(self, closure: Optional[Callable[[], object]] = None) -> None:
        """Skip on an overflow (and shrink a dynamic scale), else step the
        wrapped optimizer on the scaled FP16 gradients, writing the FP16 weights."""
        grads, norms, skip = self._norms()
        if skip:
            self._update_scale(True)
            return
        outputs = [[flat] for flat in self.fp16_groups_flat] if self._flat else self.fp16_groups
        self.optimizer.step(grads=grads, output_params=outputs, scale=self.cur_scale, grad_norms=norms)
        if self._flat:
            for group, flat in zip(self.fp16_groups, self.fp16_groups_flat):
                self._point_into(group, flat)
        self._update_scale(False)

    def _update_scale(self, skip: bool) -> None:
        if skip and (self.verbose or not self.dynamic_loss_scale):
            kind = "dynamic" if self.dynamic_loss_scale else "static"
            log.warning("Grad overflow on iteration %d; using %s loss scale of %s", self.cur_iter, kind, self.cur_scale)
        if self.dynamic_loss_scale:
            if skip:
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> Dict[str, Any]:
        """Apex's checkpoint: the scaler's fields, ``optimizer_state_dict`` and the FP32 masters."""
        sd: Dict[str, Any] = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale,
                              "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            sd.update(last_overflow_iter=self.last_overflow_iter, scale_factor=self.scale_factor,
                      scale_window=self.scale_window)
        sd["optimizer_state_dict"] = self.optimizer.state_dict()
        if self._flat:
            sd["fp32_groups_flat"] = self.fp32_groups_flat
        else:
            sd["fp32_groups"] = self.fp32_groups
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ``state_dict()``'s output: the scaler, the wrapped optimizer, and the masters' exact values."""
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.cur_scale = state_dict["cur_scale"]
        self.cur_iter = state_dict["cur_iter"]
        if self.dynamic_loss_scale:
            self.last_overflow_iter = state_dict["last_overflow_iter"]
            self.scale_factor = state_dict["scale_factor"]
            self.scale_window = state_dict["scale_window"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        if self._flat:
            for current, saved in zip(self.fp32_groups_flat, state_dict["fp32_groups_flat"]):
                current.data.copy_(saved.data)
        else:
            for current, saved in zip(self.fp32_groups, state_dict["fp32_groups"]):
                for c, s in zip(current, saved):
                    c.data.copy_(s.data)


class ContribFP16_Optimizer(FP16_Optimizer):
    """``apex.contrib.optimizers.FP16_Optimizer``: ``FP16_Optimizer`` with one
    FP32 master per parameter (``fp32_groups``) and the overflow check of
    ``amp_C.multi_tensor_l2norm`` into ``overflow_buf``.

    Example::

        from apex.contrib.optimizers import FusedAdam, FP16_Optimizer
        optimizer = FP16_Optimizer(FusedAdam(model.half().parameters()), static_loss_scale=128.0)
    """

    _flat = False
