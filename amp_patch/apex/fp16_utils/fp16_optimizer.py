"""Stands in for ``apex.fp16_utils.fp16_optimizer``: ``FP16_Optimizer``, and
the ``FP16_Module`` of 2018 Apex.

``FP16_Optimizer`` wraps a torch optimizer built on a half-precision model
(``network_to_half(model)``, ``model.half()``). Underneath it is amp_patch's
O2 machinery, used on its own: ``MasterWeights`` puts FP32 masters in place of
the half parameters in the optimizer's ``param_groups`` and moves the half
gradients into them, and amp_patch's ``LossScaler`` holds the loss scale.
Unscaling and the inf/NaN check are torch's fused
``_amp_foreach_non_finite_check_and_unscale_``. It never calls
``amp_patch.initialize`` and patches nothing in torch.

The loss scale follows the Apex releases that last shipped this class (which
used ``apex.amp``'s scaler, not ``DynamicLossScaler``): dynamic scaling starts
at 2**16, halves on overflow and skips that step, doubles after
``scale_window`` (2000) clean updates, and never exceeds 2**24; it is updated
by each ``update_master_grads``, which ``backward`` calls.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, DefaultDict, Dict, List, Optional

import torch
from torch import nn

from ...diagnostics import warn_user
from ...patching.cast import LOW, cast
from ...precision.master import MasterWeights, params_of
from ...scaling.scaler import DEFAULTS, LossScaler
from .fp16util import clip_grad_norm

__all__ = ["FP16_Module", "FP16_Optimizer", "fp16_to_fp32", "fp32_to_fp16"]

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
f32 = torch.float32

#: what ``dynamic_loss_args`` may hold: ``DynamicLossScaler``'s keywords (which
#: Apex documented) and those of ``apex.amp``'s scaler (which it passed them to)
DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale")


def fp32_to_fp16(val: object) -> Any:
    """``val`` (a tensor, or tuples and lists of them) with its FP32 tensors made FP16.

    Example::

        inputs = fp32_to_fp16((x, mask))
    """
    return cast(val, torch.float16, None)


def fp16_to_fp32(val: object) -> Any:
    """``val`` (a tensor, or tuples and lists of them) with its FP16 tensors made FP32.

    Example::

        logits = fp16_to_fp32(model(x))
    """
    return cast(val, f32, None)


class FP16_Module(nn.Module):
    """``module`` made ``.half()``, taking FP32 inputs and giving FP32 outputs.

    Args:
        module: the model, converted in place and kept as ``self.module``.

    Example::

        model = FP16_Module(net)
        out = model(torch.randn(8, 16))     # out is FP32
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.add_module("module", module.half())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs), **kwargs))


def _dynamic_scaler(args: Optional[Dict[str, Any]]) -> LossScaler:
    args = dict(args or {})
    unknown = sorted(set(args) - set(DYNAMIC_LOSS_ARGS))
    if unknown:
        raise TypeError(f"dynamic_loss_args has unknown keys {unknown}; the keys it takes are {list(DYNAMIC_LOSS_ARGS)}")
    given = {k: v for k, v in args.items() if v is not None}  # None: the default, as in apex.amp
    # the last Apex took scale_factor but always used 2; DynamicLossScaler, whose
    # keyword it is, used it, so it is honoured
    factor = given.get("scale_factor", DEFAULTS["growth_factor"])
    top = given.get("max_loss_scale", DEFAULTS["max_loss_scale"])
    options = dict(
        # Apex clamps the first scale to the ceiling (the 2**32 of old
        # DynamicLossScaler arguments becomes 2**24)
        init_scale=min(given.get("init_scale", DEFAULTS["init_scale"]), top),
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=given.get("scale_window", DEFAULTS["growth_interval"]),
        min_loss_scale=given.get("min_loss_scale", DEFAULTS["min_loss_scale"]),
        max_loss_scale=top,
    )
    try:
        return LossScaler("dynamic", **options)
    except ValueError as e:
        raise ValueError(f"dynamic_loss_args={args!r}: {e}") from e


def _scaler_state(saved: Any) -> Dict[str, Any]:
    """A checkpoint's ``loss_scaler`` entry as ``LossScaler.load_state_dict`` takes it.

    Ours is that dict already. Apex pickled its scaler object: ``apex.amp``'s
    (``_loss_scale``, ``_unskipped``, ``dynamic``), or before 2019 a
    ``LossScaler`` / ``DynamicLossScaler`` of ``loss_scaler.py`` (``cur_scale``;
    ``cur_iter``, ``last_overflow_iter`` and ``scale_window`` when dynamic).
    """
    if isinstance(saved, dict):
        return saved
    if hasattr(saved, "_loss_scale"):
        return {"loss_scale": float(saved._loss_scale), "unskipped": int(saved._unskipped),
                "dynamic": bool(saved.dynamic)}
    if hasattr(saved, "cur_iter"):
        # its next update grows the scale when cur_iter - last_overflow_iter is a
        # multiple of the window; ours when its clean-update count reaches the
        # window, so that count is one less, modulo the window
        clean = (saved.cur_iter - saved.last_overflow_iter - 1) % saved.scale_window
        return {"loss_scale": float(saved.cur_scale), "unskipped": int(clean), "dynamic": True}
    if hasattr(saved, "cur_scale"):
        return {"loss_scale": float(saved.cur_scale), "dynamic": False}
    raise TypeError(
        f"FP16_Optimizer.load_state_dict: state_dict['loss_scaler'] is a {type(saved).__name__}, which is neither "
        f"FP16_Optimizer.state_dict()'s dict nor one of Apex's loss scalers"
    )


class ForwardsToOptimizer:
    """``state`` and ``param_groups`` of an optimizer wrapper are its wrapped
    optimizer's (``self.optimizer``), so schedulers and scripts that set ``lr``
    reach it (both generations of Apex's ``FP16_Optimizer``)."""

    optimizer: torch.optim.Optimizer

    @property
    def state(self) -> "DefaultDict[torch.Tensor, Any]":
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value: "DefaultDict[torch.Tensor, Any]") -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (holding the masters), e.g. to set the learning rate."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value


class FP16_Optimizer(ForwardsToOptimizer):
    """FP32 master weights and loss scaling around an optimizer of a half-precision model.

    The wrapped optimizer steps FP32 masters of the model's FP16 (or BF16)
    parameters; FP32 parameters (batchnorm kept FP32) are stepped as they are.
    After each step the masters are copied into the model. Replace
    ``loss.backward()`` with ``optimizer.backward(loss)``.

    Args:
        init_optimizer: a torch optimizer built on the model's parameters.
        static_loss_scale: the fixed loss scale, when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: scale the loss dynamically (see the module docstring).
        dynamic_loss_args: options of the dynamic scale: ``init_scale`` (2**16),
            ``scale_factor`` (2), ``scale_window`` (2000), ``min_loss_scale`` (1),
            ``max_loss_scale`` (2**24).
        verbose: log each parameter taken over (``amp_patch`` logger, INFO).

    Raises:
        TypeError: a trainable parameter is neither FP32 nor FP16/BF16, or
            ``dynamic_loss_args`` has an unknown key.

    Example::

        model = network_to_half(net)
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   dynamic_loss_scale=True)
        for x, y in data:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            optimizer.backward(loss)
            optimizer.clip_master_grads(1.0)
            optimizer.step()            # skipped when the gradients overflowed

    .. warning::
        The model's own ``.grad`` after ``backward`` is not the gradient (it
        is scaled, or already moved into the masters): read the masters'
        (``inspect_master_grad_data()``).
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[Dict[str, Any]] = None,
                 verbose: bool = True):
        self.verbose = verbose
        self.optimizer = init_optimizer
        for i, group in enumerate(init_optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad and p.dtype != f32 and p.dtype not in LOW:
                    raise TypeError(
                        f"Wrapped parameters must be either FP32 or FP16 (Apex: torch.cuda.FloatTensor or "
                        f"torch.cuda.HalfTensor); BF16 works too. Received {p.type()} with {tuple(p.shape)} "
                        f"in param group {i}"
                    )
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = _dynamic_scaler(dynamic_loss_args) if dynamic_loss_scale else LossScaler(static_loss_scale)
        self._masters = MasterWeights(init_optimizer)
        self.fp16_groups: List[List[Tensor]] = []
        self.fp32_from_fp16_groups: List[List[Tensor]] = []
        self.fp32_from_fp32_groups: List[List[Tensor]] = []
        for i, group in enumerate(init_optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {i}:")
            params = group["params"]
            for p in params:
                if p.requires_grad:
                    self.maybe_print(f"FP16_Optimizer received {p.type()} with {p.size()}")
            # Apex gives masters to trainable half parameters only; a frozen one
            # stays in the group as it is (and keeps checkpoints aligned with Apex's)
            slots = [j for j, p in enumerate(params) if p.requires_grad and p.dtype in LOW]
            self.fp32_from_fp32_groups.append([p for p in params if p.requires_grad and p.dtype == f32])
            halves = {"params": [params[j] for j in slots]}
            start = len(self._masters)
            self._masters.adopt(halves, {})
            for j, m in zip(slots, halves["params"]):
                params[j] = m
            self.fp16_groups.append(self._masters.halfs[start:])
            self.fp32_from_fp16_groups.append(self._masters.masters[start:])
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm: Callable[..., Tensor] = clip_grad_norm
        self._found: Dict[torch.device, Tensor] = {}  # inf/NaN seen since the last step, per device
        self._pending = False  # a scaled backward ran since the last update_master_grads
        self._fp32_unscaled = False  # the FP32 parameters' gradients are true gradients
        self._parked: List[tuple] = []  # (FP32 parameter, its true gradient) while a scaled backward runs

    def maybe_print(self, msg: str) -> None:
        """Log ``msg`` (``amp_patch`` logger, INFO) when ``verbose``."""
        if self.verbose:
            log.info(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ------------------------------------------------------------ gradients

    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or, with ``set_grads_to_None``, drop) the masters', FP32
        parameters' and the model's half gradients.

        Example::

            optimizer.zero_grad()
        """
        self.optimizer.zero_grad(set_to_none=set_grads_to_None)
        self._masters.zero_model_grads(set_grads_to_None)
        self._found.clear()
        self._pending = self._fp32_unscaled = False
        self._parked = []

    def backward(self, loss: Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backward of ``loss.float() * loss_scale``, then (by default)
        ``update_master_grads()``.

        Args:
            loss: the loss, FP32 or FP16.
            update_master_grads: move the gradients into the masters now. Pass
                False for all but the last of several losses of one step, then
                call ``update_master_grads()`` once.
            retain_graph: passed to ``torch.Tensor.backward``.

        Example::

            optimizer.backward(loss1, update_master_grads=False)
            optimizer.backward(loss2, update_master_grads=False)
            optimizer.update_master_grads()
        """
        if self._fp32_unscaled and not self._pending:
            # the FP32 parameters hold true gradients: keep the scaled ones apart
            self._park_fp32_grads()
        (loss.float() * self.loss_scaler.scale).backward(retain_graph=retain_graph)
        self._pending = True
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Make the gradients of the last backward(s) true FP32 gradients where
        the optimizer reads them: half gradients move into the masters, all are
        unscaled and (dynamic scaling) checked for inf/NaN, which sets
        ``overflow`` and moves the loss scale.

        Needed only after ``backward(..., update_master_grads=False)``.

        Example::

            optimizer.update_master_grads()
        """
        unscale = self._unscale if self.loss_scaler.active else None
        self._masters.collect_grads(unscale)
        if self._pending:
            grads = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
            if grads and unscale is not None:
                unscale(grads)
            self._unpark_fp32_grads()
            self._pending = False
            self._fp32_unscaled = True
        if self.dynamic_loss_scale:
            # inf/NaN since the last step counts, as Apex's gradients, summed in
            # the model, would still hold it
            self.overflow = any(bool(f) for f in self._found.values())
        self.loss_scaler.update(self.overflow)

    def _unscale(self, tensors: List[Tensor]) -> None:
        inv = 1.0 / self.loss_scaler.scale
        by_device: Dict[torch.device, List[Tensor]] = {}
        for t in tensors:
            t = t._values() if t.is_sparse else t
            by_device.setdefault(t.device, []).append(t)
        for dev, ts in by_device.items():
            if not self.dynamic_loss_scale:
                torch._foreach_mul_(ts, inv)  # Apex checks a static scale for nothing
                continue
            found = self._found.get(dev)
            if found is None:
                found = self._found[dev] = torch.zeros((), dtype=f32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(ts, found, torch.full((), inv, dtype=f32, device=dev))

    def _park_fp32_grads(self) -> None:
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None:
                self._parked.append((p, p.grad))
                p.grad = None

    @torch.no_grad()
    def _unpark_fp32_grads(self) -> None:
        for p, g in self._parked:
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        self._parked = []

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the FP32 gradients the optimizer steps (``torch.nn.utils.clip_grad_norm_``).

        Args:
            max_norm: the largest total norm.
            norm_type: the p of the p-norm (``float("inf")`` for the max norm).

        Returns:
            the total norm before clipping, or -1 when the last gradients
            overflowed (``overflow``).

        Example::

            optimizer.backward(loss)
            optimizer.clip_master_grads(1.0)
            optimizer.step()
        """
        if self.overflow:
            return -1
        return self.clip_grad_norm(list(params_of(self.optimizer)), max_norm, norm_type)

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[Tensor]]]]:
        """The FP32 gradients the optimizer steps, one list per param group
        (None for a parameter without one); None after an overflow.

        Example::

            grads = optimizer.inspect_master_grad_data()
        """
        if self.overflow:
            warn_user(
                "calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
                "Gradients are currently invalid (may be inf, nan, or stale).  Returning None."
            )
            return None
        return [[None if p.grad is None else p.grad.detach() for p in group["params"]]
                for group in self.optimizer.param_groups]

    # ------------------------------------------------------------ step

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step the masters and copy them into the model, or skip the step
        when the gradients overflowed.

        Args:
            closure: for optimizers that re-evaluate the loss (LBFGS). It must
                call ``optimizer.zero_grad()`` and ``optimizer.backward(loss)``
                and return the loss; an overflowing evaluation is repeated at the
                lowered scale.

        Returns:
            what the wrapped optimizer's step returns; None when skipped.

        Example::

            def closure():
                optimizer.zero_grad()
                loss = loss_fn(model(x).float(), y)
                optimizer.backward(loss)
                return loss
            optimizer.step(closure)
        """
        if self.overflow:
            log.warning("Gradient overflow.  Skipping step, reducing loss scale to %s", self.loss_scale)
            self._end_step()
            return None
        if closure is None:
            retval = self.optimizer.step()
        else:
            retval = self._step_with_closure(closure)
        self._masters.refresh()
        self._end_step()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def evaluate():
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # the optimizer moved the masters since the model last saw them
                self._masters.refresh()
            loss = closure()
            while self.overflow:
                log.warning("OVERFLOW within closure! Skipping step, reducing loss scale to %s", self.loss_scale)
                loss = closure()
            return loss

        retval = self.optimizer.step(evaluate)
        self.first_closure_call_this_step = True
        return retval

    def _end_step(self) -> None:
        # the step used up the masters' gradients: the next backward starts a
        # new sum, so model.zero_grad() between steps is enough, as it was in Apex
        self._masters.consumed()
        self._found.clear()

    # ------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state, the loss scale's and the FP32 masters, under Apex's keys.

        ``loss_scaler`` is a dict (Apex pickled its scaler object), so the
        checkpoint loads with ``torch.load(..., weights_only=True)``.

        Example::

            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "ckpt.pt")
        """
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": self.fp32_from_fp16_groups,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load ``state_dict()`` output, or a checkpoint of Apex's ``FP16_Optimizer``.

        The masters get the checkpoint's exact FP32 values and the model their
        rounding, so training continues as if never interrupted. This
        optimizer keeps its own kind of loss scale (static or dynamic); a
        checkpoint of the other kind loads everything but the scale, with a
        warning.

        Raises:
            ValueError: the checkpoint's masters do not match this optimizer's
                param groups.

        Example::

            ckpt = torch.load("ckpt.pt")
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        """
        saved_masters = state_dict["fp32_from_fp16"]
        shapes = [[tuple(m.shape) for m in g] for g in self.fp32_from_fp16_groups]
        saved_shapes = [[tuple(m.shape) for m in g] for g in saved_masters]
        if shapes != saved_shapes:
            raise ValueError(
                f"FP16_Optimizer.load_state_dict: the checkpoint's FP32 masters (shapes per param group "
                f"{saved_shapes}) do not match this optimizer's ({shapes}); build the model and the optimizer "
                f"as they were when the checkpoint was saved"
            )
        for note in self.loss_scaler.load_state_dict(_scaler_state(state_dict["loss_scaler"])):
            log.warning("FP16_Optimizer.load_state_dict: %s", note)
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved in zip(self.fp32_from_fp16_groups, saved_masters):
                if current:
                    torch._foreach_copy_(current, [s.detach() for s in saved])
        self._masters.refresh()

    # ------------------------------------------------------------ the wrapped optimizer's attributes

    @property
    def loss_scale(self) -> float:
        """The current loss scale; settable."""
        return self.loss_scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.scale = float(value)
