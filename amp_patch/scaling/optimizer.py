"""The attached optimizers' patched methods: ``step`` (skipped on overflow,
masters refreshed after), ``zero_grad`` and ``add_param_group``, put on each
optimizer as instance attributes and taken off at the end of the session."""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence

import torch

from ..base import running
from ..base.eager import eager
from ..base.errors import StateError
from . import steps
from .patches import ensure_patches
from .state import Handle, LossScaling, Stage, decide_skips, transfer, transfer_all

if TYPE_CHECKING:
    from ..base.undo import Owned
    from ..precision.master import MasterWeights
    from ..precision.optimizers import Built

Tensor = torch.Tensor
_NOTSET = object()

def _lookup(optimizer: torch.optim.Optimizer) -> Optional[Handle]:
    amp = running.session()
    return None if amp is None else amp.handle_of(optimizer)


def _step(self, *args: Any, **kwargs: Any) -> Any:
    h = _lookup(self)
    if h is None:  # a stale reference after deinitialize
        return type(self).step(self, *args, **kwargs)
    flight = h.run.hooks.flight
    if not flight.enter("step"):  # the session ended while this call waited for it
        return self.step(*args, **kwargs)
    try:
        return _run_step(self, h, args, kwargs)
    finally:
        flight.leave()


def _run_step(self: torch.optim.Optimizer, h: Handle, args: tuple, kwargs: dict) -> Any:
    # The LR scheduler's "step() before optimizer.step()" check reads this flag;
    # a skipped step was still a call of step(), as with GradScaler.
    self._opt_called = True
    run = h.run
    closure = args[0] if args else kwargs.get("closure")
    evaluated = _NOTSET
    if closure is not None:
        rest = tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "closure"}
        if any(s.active for s in run.scalers):
            if not _evaluates_once(self):
                raise StateError(
                    f"{type(self).__name__}.step(closure) is not supported while loss scaling is active: it may "
                    f"call the closure more than once inside the step, each backward after the gradients were "
                    f"checked. Call loss = closure() before optimizer.step(), or use BF16 (no loss scaling)."
                )
            # torch's optimizers (LBFGS aside) call the closure once, before they read a
            # gradient: called here first, as PyTorch Lightning's mixed precision does for
            # GradScaler, its backward is checked and unscaled like any other
            with torch.enable_grad():
                evaluated = closure()
            closure = None
            args, kwargs = rest
        else:
            args, kwargs = (_AbsorbAfter(closure, run, h.masters),) + rest[0], rest[1]
    _refuse_traced_backward(h)
    mw = h.masters
    decide_skips(run)
    if mw is not None:
        # what the script did to the model since the backward reaches the masters
        mw.model_view.take()
        mw.weight_writes.take()
    decision = h.skip
    if isinstance(decision, Tensor):
        # sync-free: a step that reads the device flag itself. The flag stands until
        # the next backward, so a second step() without one decides as this one did.
        taken, out = steps.take(h, decision, closure is not None, args, kwargs)
        if taken:
            h.count(decision)
            if mw is not None:
                mw.weight_writes.note()
                mw.consumed()
            return out if evaluated is _NOTSET else evaluated
    # the decision on the host: under sync-free steps, the one sync of a step no link
    # of the chain can take with the flag (docs/guide.md, "Steps with no host sync")
    skip = bool(decision)
    out = None
    if not skip:
        # A skip decision stands until the next backward: a second step() with
        # no backward in between must not apply the overflowed gradients.
        h.skip = None
        out = steps.take(h, False, closure is not None, args, kwargs)[1]
    h.count(skip)
    if mw is not None:
        mw.weight_writes.note()
        mw.consumed()
    return out if evaluated is _NOTSET else evaluated  # torch's step returns the closure's loss


def _evaluates_once(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step(closure)`` calls the closure once, before anything
    else: torch's own optimizers and Apex's (amp_patch.apex), all but LBFGS. A
    third-party optimizer may call it again after moving the weights (SAM)."""
    module = type(optimizer).__module__
    ours = module.startswith("torch.optim") or module.startswith("amp_patch.apex")
    return ours and not isinstance(optimizer, torch.optim.LBFGS)


def _refuse_traced_backward(h: Handle) -> None:
    """A backward that ``torch.compile`` traced itself (``trace_autograd_ops``) never
    reaches the patched ``Tensor.backward``: its loss was not scaled and nothing was
    checked. Gradients with no amp_patch backward behind them while that option is
    on are refused here, before they are applied unchecked."""
    config = sys.modules.get("torch._dynamo.config")
    if config is None or not getattr(config, "trace_autograd_ops", False) or not h.run.plain:
        return
    if h.stage is not Stage.READY or h.fed_by or h.skip is not None:
        return  # a backward amp_patch ran fed this step
    params = h.masters.halfs if h.masters is not None else h.own_params()
    if any(p.grad is not None for p in params):
        raise StateError(
            f"{type(h.optimizer).__name__}.step(): its gradients come from a backward that torch.compile traced "
            f"itself (torch._dynamo.config.trace_autograd_ops=True), which bypasses amp_patch: the loss was not "
            f"scaled and the gradients were not checked for inf/NaN. Set trace_autograd_ops=False (the compiled "
            f"function then breaks its graph at loss.backward(), which amp_patch runs), or call loss.backward() "
            f"outside the compiled function."
        )


class _AbsorbAfter:
    """A closure that runs the model on the masters' current values (LBFGS calls it
    again after each trial update of the masters, inside one step) and moves its
    gradients into the masters before the optimizer reads them."""

    def __init__(self, closure: Callable[[], object], run: LossScaling, masters: Optional["MasterWeights"]):
        self.closure, self.run, self.masters = closure, run, masters

    def __call__(self) -> object:
        if self.masters is not None:
            self.masters.refresh()
        loss = self.closure()
        transfer_all(self.run)
        return loss


def _zero_grad(self, set_to_none: Optional[bool] = None) -> None:
    # None: the optimizer's own default decides (torch's is True; Apex's
    # FusedSGD keeps its constructor's set_grad_none)
    args = () if set_to_none is None else (set_to_none,)
    h = _lookup(self)
    if h is None:
        return type(self).zero_grad(self, *args)
    h.originals["zero_grad"](*args)
    if h.masters is not None:
        h.masters.zero_model_grads(True if set_to_none is None else set_to_none)
    # the gradients are gone, and with them what was decided about them
    h.move(Stage.READY)
    h.parked = None
    h.skip = None
    h.fed_by.clear()


def _add_param_group(self, param_group: dict) -> None:
    h = _lookup(self)
    if h is None or h.masters is None:
        return type(self).add_param_group(self, param_group)
    # a converted model's parameter comes back from deinitialize in its dtype from before
    before = h.run.hooks.dtypes_before()
    h.originals["add_param_group"](h.masters.add_group(param_group, before))
    h.run.refresh_plain()


for _f, _name in ((_step, "step"), (_zero_grad, "zero_grad"), (_add_param_group, "add_param_group")):
    _f.__name__ = _name
    _f.__qualname__ = f"amp_patch.{_name}"
# The LR scheduler wraps optimizer.step once to track calls; ours sets the flag it
# reads, so it must neither wrap again nor warn that step was overridden.
# Each runs eagerly under torch.compile (base.eager): a graph cannot hold the skip decision.
_step, _zero_grad, _add_param_group = eager(_step), eager(_zero_grad), eager(_add_param_group)
_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


_PATCHES = {"step": _step, "zero_grad": _zero_grad, "add_param_group": _add_param_group}


def _patch(h: Handle) -> None:
    opt = h.optimizer
    names = ["step", "zero_grad"] + (["add_param_group"] if h.masters is not None else [])
    for name in names:
        h.saved[name] = vars(opt).get(name, _NOTSET)
        h.originals[name] = getattr(opt, name)
        setattr(opt, name, types.MethodType(_PATCHES[name], opt))
    h.patched = True


class _RestoreMethods:
    """Undo callback for one optimizer: pending gradients unscaled, methods restored."""

    def __init__(self, h: Handle):
        self.h = h

    def __call__(self) -> None:
        h = self.h
        try:
            transfer(h.run, h)
        finally:
            opt = h.optimizer
            for name, old in h.saved.items():
                if getattr(vars(opt).get(name), "__func__", None) is not _PATCHES[name]:
                    continue  # someone replaced our method since; theirs calls ours, which calls through
                if old is _NOTSET:
                    delattr(opt, name)
                else:
                    setattr(opt, name, old)
            h.patched = False
            if h in h.run.handles:
                h.run.handles.remove(h)



def attach(run: LossScaling, undo: "Owned", optimizers: Sequence[torch.optim.Optimizer],
           built: Optional[Dict[int, "Built"]] = None) -> None:
    """Give each loss a scaler (first call) and attach ``optimizers`` to ``run``, with
    the masters ``precision.optimizers.attach`` built for them (``built``).

    Patches each optimizer's ``step``, ``zero_grad`` (and ``add_param_group``
    when it has masters) as instance attributes; the undo, pushed onto ``undo``,
    restores them.
    """
    for opt in optimizers:
        h = run.handle(opt, undo)
        if h.patched:
            continue
        if built and id(opt) in built:
            h.masters, h.compiled, h.onepass = built[id(opt)]
        _patch(h)
        if h.onepass is not None:
            h.onepass.original = h.originals["step"]
        run.handles.append(h)
        undo.push(_RestoreMethods(h))
    ensure_patches(run)


def attach_wrappers(wrappers: Sequence[Any], undo: Any) -> None:
    """Make each optimizer wrapper's ``step`` (Apex's ``LARC``, which reads the
    gradients to rescale them before its optimizer's step) see true gradients:
    the attached optimizer inside is unscaled first (into the masters under
    O2), and its own patched step then skips on overflow as usual. The undo
    of each goes on ``undo``."""
    for w in wrappers:
        saved = vars(w).get("step", _NOTSET)
        w.step = types.MethodType(_wrapper_step, w)
        undo.push(_RestoreWrapper(w, saved))


def _wrapper_step(self, *args: Any, **kwargs: Any) -> Any:
    h = _lookup(self.optim)
    if h is not None:
        transfer(h.run, h)
    return type(self).step(self, *args, **kwargs)


class _RestoreWrapper:
    def __init__(self, wrapper: Any, saved: object):
        self.wrapper, self.saved = wrapper, saved

    def __call__(self) -> None:
        if self.saved is _NOTSET:
            del self.wrapper.step
        else:
            self.wrapper.step = self.saved
