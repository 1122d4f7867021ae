"""Stands in for ``apex.fp16_utils.loss_scaler``: the loss scalers of Apex's
manual FP16 recipe, ``LossScaler`` (static) and ``DynamicLossScaler``.

Scripts drive these by hand (``scaler.backward(loss)``,
``scaler.has_overflow(params)``, ``scaler.update_scale(overflow)``), and old
``FP16_Optimizer`` checkpoints pickled them, so they keep Apex's rules and
Apex's attribute names (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
``scale_factor``, ``scale_window``): unpickling such a checkpoint restores
those attributes straight into these classes. That is why they are not
amp_patch's ``LossScaler`` (``amp_patch.scaling.scaler``), whose rules are
those of later Apex: ``DynamicLossScaler`` starts at 2**32, has a floor of 1
but no ceiling, grows by ``scale_factor`` every ``scale_window`` clean
iterations counted from the last overflow, and is updated by whoever calls
``update_scale``, not by a step.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from .fp16util import to_python_float

__all__ = ["DynamicLossScaler", "LossScaler", "to_python_float"]

Tensor = torch.Tensor


class _Scaling:
    """What both scalers do with their current scale ``cur_scale``."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.cur_scale

    def scale_gradient(self, module: torch.nn.Module, grad_in: Tuple[Optional[Tensor], ...],
                       grad_out: Tuple[Optional[Tensor], ...]) -> Tuple[Optional[Tensor], ...]:
        """A module backward hook that multiplies the gradients flowing in by the loss scale."""
        return tuple(None if g is None else g * self.loss_scale for g in grad_in)

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        """Backward of ``loss * loss_scale``."""
        (loss * self.loss_scale).backward(retain_graph=retain_graph)


class LossScaler(_Scaling):
    """A fixed loss scale: it never finds an overflow and never changes.

    Args:
        scale: the loss scale.

    Example::

        scaler = LossScaler(128.0)
        scaler.backward(loss)              # gradients are 128x the true ones
        for m in master_params:
            m.grad.mul_(1.0 / scaler.loss_scale)
    """

    def __init__(self, scale: float = 1):
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass


class DynamicLossScaler(_Scaling):
    """A loss scale that backs off on overflow and grows while gradients stay finite.

    Each ``update_scale(overflow)`` is one iteration: an overflow divides the
    scale by ``scale_factor`` (never below 1) and the caller skips that step;
    every ``scale_window``-th iteration without one since the last overflow
    multiplies it by ``scale_factor``.

    Args:
        init_scale: the first scale.
        scale_factor: what the scale is divided or multiplied by.
        scale_window: clean iterations between growths.

    Example::

        scaler = DynamicLossScaler()
        scaler.backward(loss)
        overflow = scaler.has_overflow(model_params)
        if not overflow:
            model_grads_to_master_grads(model_params, master_params)
            for m in master_params:
                m.grad.mul_(1.0 / scaler.loss_scale)
            optimizer.step()
            master_params_to_model_params(model_params, master_params)
        scaler.update_scale(overflow)
    """

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[Tensor]) -> bool:
        """True when a gradient of ``params`` holds an inf or NaN."""
        return any(p.grad is not None and self._has_inf_or_nan(p.grad) for p in params)

    @staticmethod
    def _has_inf_or_nan(x: Tensor) -> bool:
        if x.is_sparse:
            x = x._values()
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow: bool) -> None:
        """Move the scale for one iteration that did (``True``) or did not overflow."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        else:
            # the iteration counter starts at 0 with the "last overflow" at -1, so
            # clean iterations since then are cur_iter - last_overflow_iter
            clean = self.cur_iter - self.last_overflow_iter
            if clean % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
