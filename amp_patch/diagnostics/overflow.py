"""Overflow provenance (``initialize(..., find_overflow=True)``, or
``find_overflow()`` for the next step) watches every torch call and every
module of the models: the first output, or gradient of an output, that holds
inf or NaN is remembered with its op, module and dtype. When the loss scaler
skips a step it calls ``on_skipped_step``, which names them in a warning and
suggests the YAML override that moves the op to FP32.

Its cost, only while armed: every torch call goes through a Python
``TorchFunctionMode``; each floating-point output is checked for inf/NaN with
one min/max pass (on CUDA a device synchronisation per op); the backward node
of each output that requires grad gets a hook that checks the gradients it
produces the same way.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from ..base import running
from ..base.errors import StateError
from . import modes
from ..patching.wrappers import op_on_stack, tensors_in
from ..oplists import NAMESPACES, OPERATOR_FORMS
from .notices import AmpWarning, stacklevel
from .stats import dtype_name

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .state import Diagnostics

log = logging.getLogger("amp_patch")

# ------------------------------------------------------------ overflow provenance


_tensors = tensors_in  # every tensor in nested lists, tuples and dicts


def _finite(t: torch.Tensor) -> bool:
    # One min/max pass: inf shows at an end, NaN propagates. Several times
    # faster than isfinite(t).all(), which writes a boolean tensor first.
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _all_finite(obj: object) -> bool:
    return all(_finite(t) for t in _tensors(obj) if t.is_floating_point())


def _first_non_finite(obj: object) -> Optional[torch.Tensor]:
    return next((t for t in _tensors(obj) if t.is_floating_point() and not _finite(t)), None)


#: how _cast converts a tensor (``to``, or the dtype methods it calls through
#: ``cast.CONVERT``): an overflow there is the cast's, not the op's
_CAST_OPS = frozenset(("torch.Tensor", n) for n in ("to", "half", "bfloat16", "float"))


#: factories whose output is uninitialized memory, which may hold any bit pattern,
#: NaN and inf included: what they return is no overflow (the op that fills it is watched)
_UNINITIALIZED = frozenset(("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"))


def _running_wrapper_op(names: modes.OpNames) -> Optional[str]:
    """The patched op whose casting wrapper is on the stack, if any.

    Walks frames, so only for the one call that found an inf/NaN. Every
    wrapper has wrapt's signature, so ``wrapped`` names the op it wraps.
    """
    running, wrapped = op_on_stack(sys._getframe(1))
    if not running:
        return None
    found = names.names(wrapped)
    return modes.qualname(found[0]) if found else getattr(wrapped, "__qualname__", None)


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where the inf/NaN of a skipped step first appeared.

    Attributes:
        loss_id, step: the loss whose step was skipped, and that step.
        kind: ``"output"`` (an op's output in the forward pass), ``"cast"``
            (amp_patch's cast of an input of ``op`` overflowed), ``"gradient"``
            (the backward of ``op`` produced it), ``"cast_gradient"`` (the
            gradient of an input of ``op`` overflowed when cast back to the
            half dtype), or ``None`` when nothing watched was non-finite.
        op: the op's public name (``torch.nn.functional.linear``), or None
            when only a module output was seen.
        module: the module it ran in (``"encoder.fc2"``), or None.
        module_type: that module's class name.
        dtype: the dtype of the non-finite tensor (what the op ran in).
        inputs_finite: whether what the op received was finite (its inputs
            in the forward pass, its output's gradients in the backward).
    """

    loss_id: int
    step: Optional[int]
    kind: Optional[str] = None
    op: Optional[str] = None
    module: Optional[str] = None
    module_type: Optional[str] = None
    dtype: Optional[str] = None
    inputs_finite: Optional[bool] = None
    patching: bool = True  # the run patches torch functions (O1/O4), so op lists apply

    @property
    def yaml(self) -> Optional[str]:
        """The op-list override that runs ``op`` in FP32 (under O1/O4, where op lists
        apply), or None."""
        if self.op is None or self.dtype == "float32" or self.kind == "cast_gradient":
            return None
        for ns in sorted(NAMESPACES, key=len, reverse=True):
            if self.op.startswith(ns + "."):
                name = self.op[len(ns) + 1:]
                # ``a - b`` reaches the mode as Tensor.sub but is patched as __sub__
                names = [name] + list(OPERATOR_FORMS.get(name, ())) if ns == "torch.Tensor" else [name]
                return f"{ns}:\n  float: [{', '.join(names)}]\n"
        return None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["yaml"] = self.yaml
        return d

    def __str__(self) -> str:
        step = "a step" if self.step is None else f"step {self.step}"
        head = f"amp_patch: {step} of loss {self.loss_id} was skipped for inf/NaN gradients."
        if self.kind is None:
            return (
                f"{head} find_overflow saw no non-finite op output or gradient since it was armed; "
                f"arm it before the forward pass of the step to examine (amp_patch.find_overflow())."
            )
        what = self.op or "the output"
        where = f" in module '{self.module}' ({self.module_type})" if self.module else ""
        if self.kind == "output":
            src = "" if self.inputs_finite is None else (
                ", from finite inputs" if self.inputs_finite
                else ", from inputs that already held inf/NaN (check the data and the weights)"
            )
            text = f"{head} The first non-finite value was the output of {what}{where}, computed in {self.dtype}{src}."
        elif self.kind == "cast":
            text = (
                f"{head} The first non-finite value came from casting an input of {what}{where} to "
                f"{self.dtype}: the value is beyond {self.dtype}'s range."
            )
        elif self.kind == "gradient":
            src = "finite gradients" if self.inputs_finite else "gradients that already held inf/NaN"
            text = (
                f"{head} The first non-finite gradient came from the backward of {what}{where}, "
                f"in {self.dtype}, from {src}."
            )
        else:
            text = (
                f"{head} The first non-finite gradient came from casting the gradient of an input of "
                f"{what}{where} back to {self.dtype}: it is beyond {self.dtype}'s range. That is the "
                f"loss scale at work: a dynamic scale lowers itself and retries. If it keeps happening, "
                f"run the op that produces that input in float32."
            )
        body = "\n".join("  " + line for line in (self.yaml or "").splitlines())
        if self.yaml and self.patching:
            text += f"\nTo run it in float32, add to an op-list override (initialize(..., lists='amp_fp32.yaml')):\n{body}"
        elif self.yaml:
            keep = (
                f" initialize(..., keep_fp32=[{self.module!r}]) runs that module in float32 (its output "
                f"still returns to {self.dtype}, so this helps when the overflow is inside it);"
                if self.module else ""
            )
            text += (
                f"\nThis opt level runs the whole model in {self.dtype}; op lists do not apply to it.{keep} "
                f"half_dtype=torch.bfloat16 has float32's range; or opt_level='O1' runs only listed ops in "
                f"{self.dtype} and takes this override (lists='amp_fp32.yaml'):\n{body}"
            )
        elif self.dtype == "float32":
            text += " It already ran in float32: the values themselves overflow; check the inputs and the learning rate."
        return text


class _OverflowWatch:
    """The hooks and the mode observer that find the first inf/NaN."""

    def __init__(self, diag: "Diagnostics", once: bool):
        #: the session's diagnostics, which hold this watch: its models, scalers and settings
        self.diagnostics = diag
        self.once = once
        self.names = modes.OpNames(diag.patcher, diag.table)
        self.event: Optional[dict] = None
        self.stack: List[Tuple[str, str]] = []  # (module label, class name), innermost last
        self.handles: List["RemovableHandle"] = []
        self.marks: tuple = ()
        self.last: Optional[Provenance] = None
        self.armed = False

    def _marks(self) -> tuple:
        # The newest history entry of each scaler: it changes with every
        # step, and reading it is O(1) however long the history.
        return tuple(_last_entry(s) for s in self.diagnostics.scalers())

    def arm(self) -> None:
        if self.armed:
            return
        self.marks = self._marks()
        self.event = None
        models = self.diagnostics.models
        several = len(models) > 1
        for i, model in enumerate(models):
            for name, mod in model.named_modules():
                label = ".".join(x for x in (f"model{i}" if several else "", name) if x) or type(mod).__name__
                self.handles.append(mod.register_forward_pre_hook(self._enter_hook(label, type(mod).__name__, name == "")))
                self.handles.append(mod.register_forward_hook(self._leave_hook(label, type(mod).__name__), always_call=True))
        modes.add(self._observe)
        self.armed = True

    def disarm(self) -> None:
        if not self.armed:
            return
        self.armed = False
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()
        modes.remove(self._observe)

    # -- hooks
    def _enter_hook(self, label: str, typename: str, root: bool):
        def hook(module, args):
            if root:
                self.stack.clear()
                self._step_boundary()
                if not self.armed:
                    return
            self.stack.append((label, typename))

        return hook

    def _leave_hook(self, label: str, typename: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1][0] == label:
                self.stack.pop()
            if self.event is None:
                with torch._C.DisableTorchFunction():
                    bad = _first_non_finite(output)
                if bad is not None:
                    self.event = dict(kind="output", op=None, module=label, module_type=typename,
                                      dtype=dtype_name(bad.dtype), inputs_finite=None)

        return hook

    def _step_boundary(self) -> None:
        # A new step began since the last forward: whatever was seen belongs
        # to a step that was not skipped (on_skipped_step consumes the rest).
        marks = self._marks()
        if marks != self.marks:
            self.marks = marks
            self.event = None
            if self.once:
                self.disarm()

    # -- the mode observer (already inside DisableTorchFunction)
    def _observe(self, func: object, args: tuple, kwargs: dict, out: object) -> None:
        # Only computations of the forward pass: a getter (``p.grad``)
        # computes nothing, and under no_grad the optimizer and the loss
        # scaler handle gradients that may hold inf by design.
        if self.event is not None or not self.armed or not torch.is_grad_enabled():
            return
        name = getattr(func, "__name__", None)
        if name == "__get__" or name in _UNINITIALIZED:
            return
        hooked = set()
        for t in _tensors(out):
            if not t.is_floating_point():
                continue
            if not _finite(t):
                op, cast = self._op(func)
                self.event = dict(kind="cast" if cast else "output", op=op, **self._where(),
                                  dtype=dtype_name(t.dtype), inputs_finite=_all_finite((args, kwargs)))
                return
            node = t.grad_fn
            if node is not None and id(node) not in hooked:
                hooked.add(id(node))
                op, cast = self._op(func)
                node.register_hook(self._backward_hook(op, cast, self._where()))

    def _op(self, func: object) -> Tuple[str, bool]:
        """The op's public name, and whether it is amp_patch's own cast of an
        input of a patched op (then the name is that op's)."""
        names = self.names.names(func)
        if not names:
            return getattr(func, "__name__", repr(func)), False
        if names[0] in _CAST_OPS:
            outer = _running_wrapper_op(self.names)
            if outer is not None:
                return outer, True
        return modes.qualname(names[0]), False

    def _where(self) -> dict:
        if not self.stack:
            return dict(module=None, module_type=None)
        label, typename = self.stack[-1]
        return dict(module=label, module_type=typename)

    def _backward_hook(self, op: str, cast: bool, where: dict):
        # A node hook sees what the op's backward received (grad_outputs)
        # and produced (grad_inputs): the first node to produce inf/NaN is
        # where the gradient overflowed.
        def hook(grad_inputs, grad_outputs):
            if self.event is not None or not self.armed:
                return None
            with torch._C.DisableTorchFunction():
                bad = _first_non_finite(grad_inputs)
                if bad is not None:
                    self.event = dict(kind="cast_gradient" if cast else "gradient", op=op, **where, dtype=dtype_name(bad.dtype),
                                      inputs_finite=_all_finite(grad_outputs))
            return None

        return hook

    def provenance(self, loss_id: int, step: Optional[int]) -> Provenance:
        e = self.event or {}
        return Provenance(loss_id=loss_id, step=step, patching=bool(self.diagnostics.config.patch_torch_functions), **e)


def _release(diag: "Diagnostics", watch: _OverflowWatch) -> None:
    watch.disarm()
    if diag.watch is watch:
        diag.watch = None


def arm_find_overflow(diag: "Diagnostics", once: bool = False) -> None:
    """Arm overflow provenance: for every step, or (``once``) for the next one.

    Called by ``initialize(..., find_overflow=True)``; ``find_overflow()``
    arms it once.
    """
    w = diag.watch
    if w is None:
        w = diag.watch = _OverflowWatch(diag, once)
        diag.undo.push(lambda: _release(diag, w))
    elif w.armed and not w.once:
        return  # already armed for every step
    else:
        w.once = once
    w.arm()


def _last_entry(scaler: object) -> Optional[Tuple[int, float, bool]]:
    rows = getattr(scaler, "history", None)
    try:
        return history_entry(rows[-1]) if rows else None
    except (TypeError, IndexError, KeyError):
        return None


def _scaler_step(scaler: object) -> Optional[int]:
    last = _last_entry(scaler)
    if last is None:
        return None if getattr(scaler, "history", None) is None else 0
    # The scaler may record the skipped step before or after calling us.
    return last[0] if last[2] else last[0] + 1


def on_skipped_step(diag: "Diagnostics", loss_id: int, scaler: object) -> Optional[Provenance]:
    """Called by the loss scaler when it skips a step for inf/NaN gradients.

    With overflow provenance armed, warns (``AmpWarning``) naming the first
    module and op whose output or gradient became non-finite, with its dtype
    and the YAML override that moves the op to FP32, and returns it as a
    ``Provenance``; otherwise returns None.
    """
    w = diag.watch if diag.watch is not None and diag.watch.armed else None
    if w is None:
        log.debug("amp_patch: loss %s: step skipped for inf/NaN gradients; amp_patch.find_overflow() names the op", loss_id)
        return None
    prov = w.provenance(loss_id, _scaler_step(scaler))
    w.last = prov
    w.event = None
    w.marks = w._marks()
    if w.once:
        w.disarm()
    warnings.warn(str(prov), AmpWarning, stacklevel=stacklevel())
    return prov


def last_overflow(diag: "Diagnostics") -> Optional[Provenance]:
    """The provenance of the last skipped step one session's watch found, or None."""
    w = diag.watch
    return w.last if w is not None else None


def find_overflow() -> None:
    """Name where the next skipped step's inf/NaN comes from.

    Arms overflow provenance for the next optimizer step: if the loss scaler
    skips it, an ``AmpWarning`` names the first module and op whose output or
    gradient held inf/NaN, the dtype it ran in, and the YAML override that
    runs that op in FP32 (``amp_patch.report()`` keeps it too). Call it before
    the forward pass of the step to examine. ``initialize(...,
    find_overflow=True)`` arms it for every step instead.

    Cost while armed: every torch call passes through a Python
    ``TorchFunctionMode`` and each floating-point output and gradient gets a
    min/max pass to find inf/NaN (a device synchronisation per op on CUDA):
    expect that step to take 2-4x as long. It disarms itself after the step.

    Raises:
        StateError: amp_patch is not initialized.

    Example::

        for step, (x, y) in enumerate(loader):
            if step == 100:
                amp_patch.find_overflow()   # look at this step closely
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    """
    amp = running.session()
    if amp is None:
        raise StateError(
            "amp_patch.find_overflow() needs a running AMP: call amp_patch.initialize(...) first "
            "(or pass find_overflow=True to it to watch every step)"
        )
    arm_find_overflow(amp.diagnostics, once=True)


def history_entry(item: Any) -> Optional[Tuple[int, float, bool]]:
    """One history entry as ``(step, scale, skipped)``, or None if it is not one."""
    try:
        if isinstance(item, (tuple, list)):
            step, scale, skipped = item[0], item[1], item[2]
        else:
            step, scale, skipped = item.step, item.scale, item.skipped
        return int(step), float(scale), bool(skipped)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
