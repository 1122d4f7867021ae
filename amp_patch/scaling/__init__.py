"""Loss scaling: ``scale_loss``, the patched ``loss.backward()``, ``unscale_``,
the patched ``optimizer.step`` / ``zero_grad``, and amp_patch's state dict.

Each optimizer gets a ``Handle``, an explicit per-optimizer state machine (as
``torch.amp.GradScaler`` keeps one): after a backward of loss ``l`` its
gradients are *pending* (scaled by loss ``l``'s scale, and under O2 still in the
half model); ``transfer`` makes them *unscaled* (into the FP32 masters under
O2), checking them for inf/NaN on the device; the step asks for a *verdict*.

Unscaling is deferred to the first moment true gradients are needed: the
step, ``unscale_``, ``master_params``, torch's clip functions, or a backward of
another loss into the same optimizer. So gradient accumulation unscales once,
there is one fused inf/NaN check per step over all gradients
(``torch._amp_foreach_non_finite_check_and_unscale_``), and the only host sync
is the step's verdict, one per step for all losses together (all-reduced under
``torch.distributed``). A loss whose scaler is inactive (BF16, or a static
scale of 1.0) is neither scaled, unscaled nor checked.

The rule for the patched ``Tensor.backward``: a call on a one-element tensor,
with no explicit ``gradient``, outside ``scale_loss`` and outside
``disable_casts()``, is loss 0 of every attached optimizer, exactly as if it
were written ``with scale_loss(loss, all_optimizers): ...``. Anything else
(non-scalar outputs, explicit gradients, ``torch.autograd.grad``,
``torch.autograd.backward``) runs untouched.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .. import session, diagnostics

from . import leaves

from ..precision import master
from ..errors import ConfigError, OverflowLoopError, StateError
from ..options import Options
from .scaler import LossScaler
from ..patching.wrappers import OpWrapper, switch

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor

_NOTSET = object()


# ------------------------------------------------------------------ options


def validate_options(props: Any, options: Options) -> None:
    """Check the loss-scaler options against the opt level's loss scale before anything changes.

    Raises:
        ConfigError: (a ``ValueError``) naming the option, e.g.
            ``growth_factor=0.5 must be > 1``.
    """
    try:
        LossScaler(props.loss_scale, **options.scaler_kwargs())
    except ValueError as e:
        raise ConfigError(f"initialize: {e}") from None


# ------------------------------------------------------------------ state


class Handle:
    """What amp_patch keeps for one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, run: "Run"):
        self.optimizer = optimizer
        self.run = run
        self.masters: Optional[master.MasterWeights] = None
        self.fused: Any = None  # fused.FusedUpdate under fused_update=True
        self.patched = False
        self.saved: Dict[str, Any] = {}  # replaced instance attributes: name -> own value or _NOTSET
        self.originals: Dict[str, Any] = {}  # name -> the callable we call through
        self.pending: Optional[int] = None  # loss whose scaled gradients await transfer
        self.unscaled = False  # own parameters' gradients hold true values from a transfer
        self.stash: Optional[List[Tuple[Tensor, Tensor]]] = None  # (param, true grad) parked during a scaled backward
        self.fed: set = set()  # losses that fed this optimizer since the last verdict
        self.verdict: Optional[bool] = None  # skip decision waiting for this optimizer's step
        self.steps = 0
        self.skipped = 0

    def own_params(self) -> List[Tensor]:
        """Parameters the optimizer steps directly (all of them, unless masters stand in)."""
        mw = self.masters
        if mw is None or not len(mw):
            return [p for g in self.optimizer.param_groups for p in g["params"]]
        return [p for g in self.optimizer.param_groups for p in g["params"] if not mw.is_master(p)]


class _Notices:
    """Overflow messages: rank 0 only, the first at once, then one per ``interval`` seconds."""

    interval = 10.0

    def __init__(self, verbosity: int):
        self.verbosity = verbosity
        self.last: Optional[float] = None
        self.suppressed = 0

    def overflow(self, text: str) -> None:
        if not self.verbosity or not _is_rank0():
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval:
            self.suppressed += 1
            return
        if self.suppressed:
            text += f" ({self.suppressed} more overflow messages suppressed)"
        self.last, self.suppressed = now, 0
        log.warning(text)


class Run:
    """The loss-scaling state of one ``initialize``: scalers, handles, this step's flags."""

    def __init__(self, amp: Any):
        self.amp = amp
        opts: Options = amp.options
        self.scalers: List[LossScaler] = [
            LossScaler(amp.props.loss_scale, **opts.scaler_kwargs()) for _ in range(opts.num_losses)
        ]
        self.max_skips = opts.max_consecutive_skips
        self.handles: List[Handle] = []  # patched, in attach order: what a plain backward feeds
        self.found: Dict[Tuple[int, torch.device], Tensor] = {}  # (loss, device) -> inf/NaN flag this step
        self.checked: set = set()  # losses checked since the last verdict
        self.inv: Dict[Tuple[int, torch.device], Tuple[float, Tensor]] = {}
        self.dirty = False  # something awaits a transfer or a verdict
        self.plain = False  # the patched backward has work to do
        self.notices = _Notices(opts.verbosity)
        self.warned_foreign = False  # said once that a backward reached an unattached optimizer's parameters

    def refresh_plain(self) -> None:
        self.plain = bool(self.handles) and (
            self.scalers[0].active or any(h.masters is not None and len(h.masters) for h in self.handles)
        )

    def unscaler(self, loss_id: int):
        """``unscale(tensors)`` for loss ``loss_id``, or None when it is not scaled."""
        scaler = self.scalers[loss_id]
        if not scaler.active:
            return None
        self.checked.add(loss_id)
        return _Unscale(self, loss_id, scaler.scale)

    def found_flag(self, loss_id: int, device: torch.device) -> Tensor:
        """This step's inf/NaN flag of loss ``loss_id`` on ``device`` (> 0: found), kept on the device."""
        found = self.found.get((loss_id, device))
        if found is None:
            found = self.found[(loss_id, device)] = torch.zeros((), dtype=torch.float32, device=device)
        return found

    def inv_scale(self, loss_id: int, device: torch.device, scale: float) -> Tensor:
        """``1 / scale`` as a 0-d FP32 tensor on ``device``, made once per scale."""
        cached = self.inv.get((loss_id, device))
        if cached is None or cached[0] != scale:
            cached = self.inv[(loss_id, device)] = (scale, torch.full((), 1.0 / scale, dtype=torch.float32, device=device))
        return cached[1]


class _Unscale:
    def __init__(self, run: Run, loss_id: int, scale: float):
        self.run, self.loss_id, self.scale = run, loss_id, scale

    def __call__(self, tensors: List[Tensor]) -> None:
        by_device: Dict[torch.device, List[Tensor]] = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        run, l = self.run, self.loss_id
        for dev, ts in by_device.items():
            torch._amp_foreach_non_finite_check_and_unscale_(ts, run.found_flag(l, dev), run.inv_scale(l, dev, self.scale))


def _run(amp: Any) -> Run:
    """The session's loss-scaling state, made on first use."""
    run = amp.run
    if run is None:
        run = amp.run = Run(amp)
        amp.scalers[:] = run.scalers
    return run


class _DropHandle:
    """Undo of ``handle``: the optimizer's record out of the session."""

    def __init__(self, amp: Any, optimizer: torch.optim.Optimizer):
        self.amp, self.key = amp, id(optimizer)

    def __call__(self) -> None:
        self.amp.optimizer_handles.pop(self.key, None)


def handle(amp: Any, optimizer: torch.optim.Optimizer) -> Handle:
    """The optimizer's ``Handle`` in ``amp``, created on first use (not patched yet)."""
    h = amp.optimizer_handles.get(id(optimizer))
    if h is None or h.optimizer is not optimizer:
        h = amp.optimizer_handles[id(optimizer)] = Handle(optimizer, _run(amp))
        amp.undo.push(_DropHandle(amp, optimizer))
    return h


def _home_device(amp: Any) -> torch.device:
    if amp.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(amp.device_type)


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _is_rank0() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0


# ------------------------------------------------------------------ the state machine


def transfer(run: Run, h: Handle) -> None:
    """Make ``h``'s pending gradients true gradients where its optimizer reads them.

    Device work only: unscale in place (into the masters under O2) and fold
    the inf/NaN check into this step's flag for the loss. Idempotent.
    """
    l = h.pending
    if l is None:
        return
    h.pending = None
    h.fed.add(l)
    unscale = run.unscaler(l)
    if h.masters is not None and len(h.masters):
        h.masters.absorb(unscale)
    if unscale is not None:
        grads = [p.grad for p in h.own_params() if p.grad is not None]
        if grads:
            unscale(grads)
    if h.stash:
        with torch.no_grad():
            back = [(p, g) for p, g in h.stash if p.grad is not None]
            if back:
                torch._foreach_add_([p.grad for p, _ in back], [g for _, g in back])
            for p, g in h.stash:
                if p.grad is None:
                    p.grad = g
        h.stash = None
    h.unscaled = True


def transfer_all(run: Run) -> None:
    for h in run.handles:
        if h.pending is not None:
            transfer(run, h)


def _stash(h: Handle) -> None:
    """Park the true gradients of ``h``'s own parameters while a scaled backward adds new ones."""
    parked = []
    for p in h.own_params():
        if p.grad is not None:
            parked.append((p, p.grad))
            p.grad = None
    h.stash = parked or None
    h.unscaled = False


def before_backward(run: Run, handles: Sequence[Handle], loss_id: int) -> None:
    """Get gradients ready for a backward of ``loss_id`` into ``handles``.

    Gradients of the same loss keep accumulating where autograd puts them
    (scaled; unscaled once at the step), except that a single process moves
    O2's half gradients into the FP32 masters first, so accumulation happens in
    FP32. Under ``torch.distributed`` they stay in the model, where DDP's
    ``no_sync()`` accumulation expects the whole sum at the last backward.
    Gradients of another scale are unscaled before they could mix.
    """
    scaled = run.scalers[loss_id].active
    fp32_sum = not _distributed()
    for h in handles:
        if h.pending is not None:
            to_masters = fp32_sum and h.masters is not None and len(h.masters)
            if h.pending == loss_id and not to_masters:
                continue
            transfer(run, h)
        if h.unscaled and scaled:
            _stash(h)


def after_backward(run: Run, handles: Sequence[Handle], loss_id: int) -> None:
    if not run.scalers[loss_id].active and not any(h.masters is not None and len(h.masters) for h in handles):
        return
    for h in handles:
        h.pending = loss_id
    run.dirty = True


def _verdict(run: Run) -> None:
    """Transfer everything pending and decide, with one host sync, which steps to skip."""
    if not run.dirty:
        return
    transfer_all(run)
    overflow: Dict[int, bool] = {}
    stuck: List[int] = []
    if run.checked:
        scalers = run.scalers
        dev = next(iter(run.found))[1] if run.found else _home_device(run.amp)
        per_loss = [torch.zeros((), device=dev) for _ in scalers]
        for (l, d), f in run.found.items():
            per_loss[l] = per_loss[l] + f.to(dev)
        flags = torch.stack(per_loss)
        if _distributed():
            # every rank reaches this point once per step, so the collective pairs up
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        flags = flags.tolist()  # the one host sync of the step
        for l in sorted(run.checked):
            overflow[l] = flags[l] > 0
        run.found.clear()
        run.checked.clear()
        for l, bad in overflow.items():
            s = scalers[l]
            before = s.scale
            s.update(bad)
            if bad:
                _on_overflow(run, l, s, before)
                if run.max_skips is not None and s.skips_at_min >= run.max_skips:
                    stuck.append(l)
    for h in run.handles:
        if h.fed:
            h.verdict = any(overflow.get(l, False) for l in h.fed)
            h.fed.clear()
    run.dirty = False
    if stuck:
        l = stuck[0]
        s = run.scalers[l]
        raise OverflowLoopError(
            f"loss {l}: the last {s.skips_at_min} steps all produced inf/NaN gradients with the loss scale "
            f"already at its minimum ({s.scale:g}), so every step was skipped. Some op overflows even "
            f"unscaled: find it with initialize(..., find_overflow=True), move it to FP32 with an op-list "
            f"override (lists={{'torch': {{'float': ['op_name']}}}}), train in BF16 "
            f"(half_dtype=torch.bfloat16), or lower the learning rate. "
            f"(max_consecutive_skips={run.max_skips} sets this limit.)"
        )


def settle(amp: Any) -> None:
    """Before the session ends: make every gradient a scaled backward left a
    true gradient, or drop it.

    The ``optimizer.step()`` after ``deinitialize`` is torch's own and cannot be
    skipped, so gradients that overflowed are set to None (a parameter with no
    gradient is not stepped) and one warning says so: the step then changes
    nothing, as amp_patch's skipped step would have.
    """
    run = amp.run
    if run is None:
        return
    try:
        _verdict(run)
    except OverflowLoopError:
        pass  # the verdicts are set; the session is ending anyway
    dropped = [h for h in run.handles if h.verdict]
    for h in dropped:
        for p in h.own_params():
            p.grad = None
        if h.masters is not None:
            for m in h.masters.masters:
                m.grad = None
        h.verdict = None
    if dropped and run.notices.verbosity:
        names = ", ".join(type(h.optimizer).__name__ for h in dropped)
        diagnostics.warn_user(
            f"amp_patch.deinitialize(): the last backward produced inf/NaN gradients for {names}, whose step "
            f"amp_patch would have skipped. Those gradients were dropped (set to None), so an optimizer.step() "
            f"after deinitialize changes nothing; run the next backward before stepping."
        )


def _on_overflow(run: Run, loss_id: int, scaler: LossScaler, before: float) -> None:
    change = f"loss scale {before:g} -> {scaler.scale:g}" if scaler.scale != before else f"loss scale stays {scaler.scale:g}"
    run.notices.overflow(f"amp_patch: inf/NaN gradients from loss {loss_id}; skipping the step ({change})")
    diagnostics.on_skipped_step(run.amp, loss_id, scaler)


# ------------------------------------------------------------------ patched optimizer methods


def _lookup(optimizer: Any) -> Optional[Handle]:
    amp = session.current()
    if amp is None:
        return None
    h = amp.optimizer_handles.get(id(optimizer))
    return h if h is not None and h.optimizer is optimizer and h.patched else None


def _step(self, *args: Any, **kwargs: Any) -> Any:
    h = _lookup(self)
    if h is None:  # a stale reference after deinitialize
        return type(self).step(self, *args, **kwargs)
    flight = h.run.amp.flight
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
    if closure is not None:
        if any(s.active for s in run.scalers):
            raise StateError(
                f"{type(self).__name__}.step(closure) is not supported while loss scaling is active: the "
                f"closure's backward would run inside the step, after the gradients were checked. Call "
                f"loss = closure() before optimizer.step(), or use BF16 (no loss scaling)."
            )
        args, kwargs = (_AbsorbAfter(closure, run),) + tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "closure"}
    mw = h.masters
    if h.fused is not None and closure is None and _fused_step(run, h):
        return None
    _verdict(run)
    skip = bool(h.verdict)
    if not skip:
        # A skip verdict stands until the next backward: a second step() with
        # no backward in between must not apply the overflowed gradients.
        h.verdict = None
    if skip:
        h.skipped += 1
    else:
        out = h.originals["step"](*args, **kwargs)
        if mw is not None:
            mw.refresh()
        h.steps += 1
    if mw is not None:
        mw.consumed()
    return None if skip else out


def _fused_step(run: Run, h: Handle) -> bool:
    """Take this step with the fused update if its gradients are all still in the half model.

    Returns False, with nothing done, when the plain step must run instead.
    Under a scaled loss the half gradients are checked where they are; the
    verdict is taken as for the plain step, and the update unscales as it reads.
    """
    l = h.pending
    mw = h.masters
    if l is None or h.fed or h.stash is not None or mw.carried:
        return False
    plan = h.fused.plan()
    if plan is None:
        return False
    scaler = run.scalers[l]
    # the scale this backward ran with (the verdict may change it); 1.0 when not scaled
    inv = run.inv_scale(l, plan.device, scaler.scale if scaler.active else 1.0)
    if scaler.active:
        flag = h.fused.non_finite(plan)
        if flag is None:  # the check did not compile: the plain step checks instead
            return False
        run.found_flag(l, plan.device).add_(flag)
        run.checked.add(l)
        h.fed.add(l)
        h.pending = None
        run.dirty = True
        _verdict(run)
        if h.verdict:  # as the plain step: the verdict stands until the next backward
            h.fused.drop_grads(plan)
            h.skipped += 1
            mw.consumed()
            h.unscaled = False
            return True
        h.verdict = None
    h.pending = None
    if not h.fused.run(plan, inv):  # the compile failed: the plain step, from the half gradients
        mw.absorb(None)
        grads = [m.grad for m in mw.masters if m.grad is not None]
        grads += [p.grad for p in h.own_params() if p.grad is not None]
        if scaler.active and grads:
            torch._foreach_mul_(grads, inv)
        h.originals["step"]()
        mw.refresh()
    h.steps += 1
    mw.consumed()
    h.unscaled = False
    return True


class _AbsorbAfter:
    """A closure that moves its gradients into the masters before the optimizer reads them."""

    def __init__(self, closure: Any, run: Run):
        self.closure, self.run = closure, run

    def __call__(self) -> Any:
        loss = self.closure()
        transfer_all(self.run)
        return loss


def _zero_grad(self, set_to_none: bool = True) -> None:
    h = _lookup(self)
    if h is None:
        return type(self).zero_grad(self, set_to_none)
    h.originals["zero_grad"](set_to_none)
    if h.masters is not None:
        h.masters.zero_model_grads(set_to_none)
    # the gradients are gone, and with them what was decided about them
    h.pending = None
    h.unscaled = False
    h.stash = None
    h.verdict = None
    h.fed.clear()


def _add_param_group(self, param_group: dict) -> None:
    h = _lookup(self)
    if h is None or h.masters is None:
        return type(self).add_param_group(self, param_group)
    h.originals["add_param_group"](h.masters.add_group(param_group))
    h.run.refresh_plain()


for _f, _name in ((_step, "step"), (_zero_grad, "zero_grad"), (_add_param_group, "add_param_group")):
    _f.__name__ = _name
    _f.__qualname__ = f"amp_patch.{_name}"
# The LR scheduler wraps optimizer.step once to track calls; ours sets the flag it
# reads, so it must neither wrap again nor warn that step was overridden.
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

    def __init__(self, amp: Any, h: Handle):
        self.amp, self.h = amp, h

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


# ------------------------------------------------------------------ clip functions


def _clip_targets() -> List[Tuple[Any, str]]:
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg

    names = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
    return [(owner, n) for owner in (nnu, cg) for n in names if hasattr(owner, n)]


def _make_clip_patch(amp: Any):
    def clip(wrapped, instance, args, kwargs):
        run = amp.run
        if run is None or session.current() is not amp:
            return wrapped(*args, **kwargs)
        transfer_all(run)
        if args:
            args = (_to_masters(amp, args[0]),) + tuple(args[1:])
        elif "parameters" in kwargs:
            kwargs = dict(kwargs, parameters=_to_masters(amp, kwargs["parameters"]))
        return wrapped(*args, **kwargs)

    return lambda original: OpWrapper(original, clip)


def _to_masters(amp: Any, parameters: Any) -> Any:
    """Parameters with each half model parameter replaced by its FP32 master."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    out = []
    for p in parameters:
        m = master.lookup(amp, p) if isinstance(p, Tensor) else None
        out.append(p if m is None else m)
    return out


# ------------------------------------------------------------------ seams called by frontend


def attach(amp: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give each loss a scaler (first call) and attach ``optimizers``.

    Patches each optimizer's ``step``, ``zero_grad`` (and ``add_param_group``
    when it has masters) as instance attributes; the undo restores them.
    """
    run = _run(amp)
    for opt in optimizers:
        h = handle(amp, opt)
        if h.patched:
            continue
        _patch(h)
        run.handles.append(h)
        amp.undo.push(_RestoreMethods(amp, h))
    ensure_patches(amp)


def ensure_patches(amp: Any) -> None:
    """Patch the torch functions this run needs now and does not have yet.

    ``Tensor.backward`` when a plain ``loss.backward()`` has work to do (loss
    scaling, FP32 masters to feed) or casts are on (its cast cache is emptied
    around every backward); ``clip_grad_norm_`` and its kin when gradients may
    be scaled or live in masters. A run with neither (O0; O3 at a static
    scale of 1) patches nothing on torch. Called again whenever that may
    change: an optimizer attached, a loss scale loaded.
    """
    run = _run(amp)
    run.refresh_plain()
    items = []
    if run.plain or amp.props.patch_torch_functions:
        items.append((torch.Tensor, "backward", make_backward_patch(amp)))
    if any(s.active for s in run.scalers) or amp.props.master_weights:
        items += [(owner, name, _make_clip_patch(amp)) for owner, name in _clip_targets()]
    amp.patch(items)  # skips what is patched already


def guard_foreign(run: Run, loss: Tensor, handles: Sequence[Handle], loss_id: int, scale: float) -> Tuple[bool, List[Any]]:
    """Before a backward of ``loss`` scaled by ``scale``: hook every leaf it
    reaches that no attached optimizer owns so its gradient arrives unscaled
    (``leaves.py``), an overflow there counting against ``loss_id``. Returns
    whether the backward reaches an owned leaf, and the hook handles to remove
    after it. Warns once per run when such a leaf
    is a parameter, whose optimizer then steps without overflow checks."""
    reaches, foreign = leaves.split(loss, leaves.owned_ids(handles))
    if not foreign or not reaches:
        return reaches, []
    params = [t for t in foreign if isinstance(t, torch.nn.Parameter)]
    if params and not run.warned_foreign and run.notices.verbosity:
        run.warned_foreign = True
        diagnostics.warn_user(
            f"loss.backward() reached {len(params)} parameter(s) that no optimizer given to amp_patch owns "
            f"({leaves.describe(params)}). Their gradients are unscaled as they accumulate, so they hold "
            f"true values, but their optimizer's step() is not checked for inf/NaN gradients and is never "
            f"skipped. Pass that optimizer to initialize (initialize(models, [opt1, opt2], ...)) or attach "
            f"it with amp_patch.adopt_optimizer(optimizer)."
        )
    return reaches, leaves.unscale_on_arrival(foreign, run, loss_id, scale)


def make_backward_patch(amp: Any):
    """The ``Tensor.backward`` patch: loss scaling for plain loops, and an empty cast cache.

    The cache is emptied before the backward too: the forward is over, and
    the half weight copies it holds would otherwise live until the end of
    the backward instead of being freed as autograd releases them (measured
    on the Paddle MLP, BF16 O1: backward 80 ms with the copies held, 74 ms
    without, autocast's 75 ms). A forward recomputed inside the backward
    (activation checkpointing) casts again, to the same values.
    """
    import wrapt

    run = _run(amp)
    sw = switch

    flight = amp.flight

    def make(original):
        def backward(wrapped, instance, args, kwargs):
            if not flight.enter("backward"):  # the session ended while this call waited for it
                return wrapped(*args, **kwargs)
            amp.cache.clear()
            try:
                if (
                    not run.plain
                    or sw.off
                    or flight.inside("scale_loss")
                    or (args and args[0] is not None)
                    or kwargs.get("gradient") is not None
                    or instance.numel() != 1
                ):
                    return wrapped(*args, **kwargs)
                handles = list(run.handles)
                scaler = run.scalers[0]
                hooks: List[Any] = []
                if scaler.active:
                    reaches, hooks = guard_foreign(run, instance, handles, 0, scaler.scale)
                    if not reaches:
                        # nothing amp_patch unscales: the backward of a model no
                        # attached optimizer owns runs as written, unscaled
                        return wrapped(*args, **kwargs)
                before_backward(run, handles, 0)
                loss = instance.float() * scaler.scale if scaler.active else instance
                try:
                    return original(loss, *args, **kwargs)
                finally:
                    for hook in hooks:
                        hook.remove()
                    after_backward(run, handles, 0)
            finally:
                amp.cache.clear()
                flight.leave()

        return wrapt.FunctionWrapper(original, backward)

    return make


# ------------------------------------------------------------------ public API


def _current(what: str) -> Any:
    amp = session.current()
    if amp is None:
        raise StateError(f"amp_patch.{what} needs amp_patch.initialize(model, optimizer, opt_level=...) first")
    return amp


def _handles(amp: Any, optimizers: Any, what: str) -> List[Handle]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    out = []
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"amp_patch.{what}: optimizers[{i}] is a {type(opt).__name__}, not a torch.optim.Optimizer")
        h = amp.optimizer_handles.get(id(opt))
        if h is None or h.optimizer is not opt or not h.patched:
            raise StateError(
                f"amp_patch.{what}: this {type(opt).__name__} was not passed to initialize. Pass it there "
                f"(initialize(model, [opt1, opt2], ...)) or attach it with amp_patch.adopt_optimizer(opt)."
            )
        out.append(h)
    return out


@contextlib.contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """Scale a loss for backward; apex.amp's ``scale_loss``.

    Yields ``loss.float() * scale``. After the block the gradients of
    ``optimizers``' parameters are unscaled (into the FP32 masters under O2)
    and checked for inf/NaN before they are used, and the next
    ``optimizer.step()`` of each runs or is skipped. The work is deferred to
    the first moment true gradients are needed (the step, ``unscale_``,
    ``master_params``, torch's clip functions), so accumulating several
    backward passes costs one unscale and one check per step; an overflow in
    any of them skips the step. ``delay_unscale`` and ``delay_overflow_check``
    are accepted for apex.amp compatibility; deferral makes them unnecessary.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer, or a list of them, this loss feeds.
        loss_id: which loss scaler to use, ``0 <= loss_id < num_losses``.
        model: ignored (apex.amp compatibility).
        delay_unscale: ignored (apex.amp compatibility).
        delay_overflow_check: ignored (apex.amp compatibility).

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.
        ConfigError: ``loss_id`` out of range.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2")
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            with amp_patch.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), 1.0)
            optimizer.step()
    """
    amp = _current("scale_loss")
    run = _run(amp)
    n = len(run.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ConfigError(f"scale_loss: loss_id={loss_id!r} must be an integer in [0, {n}); initialize(num_losses=...) sets how many")
    if not isinstance(loss, Tensor):
        raise ConfigError(f"scale_loss: the loss must be a tensor (the output of your loss function), got {type(loss).__name__} {loss!r}")
    handles = _handles(amp, optimizers, "scale_loss")
    scaler = run.scalers[loss_id]
    if not amp.flight.enter("scale_loss"):
        raise StateError("amp_patch.scale_loss: amp_patch was deinitialized by another thread while this call waited")
    try:
        hooks: List[Any] = []
        if scaler.active:
            hooks = guard_foreign(run, loss, run.handles, loss_id, scaler.scale)[1]
        before_backward(run, handles, loss_id)
        try:
            yield loss.float() * scaler.scale if scaler.active else loss.float()
        finally:
            for hook in hooks:
                hook.remove()
            after_backward(run, handles, loss_id)
    finally:
        amp.flight.leave()


def unscale_(optimizer: torch.optim.Optimizer) -> None:
    """Unscale ``optimizer``'s gradients now, e.g. to clip true gradients.

    Idempotent within a step: a second call, or the step itself, does not
    unscale again. Under O2 the gradients land in the FP32 masters, which
    ``master_params`` yields.

    Args:
        optimizer: an optimizer passed to ``initialize`` (or ``adopt_optimizer``).

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.

    Example::

        loss.backward()
        amp_patch.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), 1.0)
        optimizer.step()
    """
    amp = _current("unscale_")
    (h,) = _handles(amp, optimizer, "unscale_")
    transfer(h.run, h)


def master_params(optimizer: Any) -> Iterator[Tensor]:
    """Yield the FP32 parameters ``optimizer`` steps: the masters under O2, its
    own parameters otherwise; apex.amp's ``master_params``.

    Iterating first unscales the optimizer's pending gradients, so clipping
    them clips true gradients at every opt level.

    Args:
        optimizer: an optimizer (or a list of them) passed to ``initialize``.

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.

    Example::

        loss.backward()
        torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), max_norm=1.0)
        optimizer.step()
    """
    amp = _current("master_params")
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return _unscaled_params(_handles(amp, opts, "master_params"))


def _unscaled_params(handles: List[Handle]) -> Iterator[Tensor]:
    # A generator, so the unscale happens when the parameters are read.
    for h in handles:
        transfer(h.run, h)
    for h in handles:
        yield from master.params_of(h.optimizer)


def adopt_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Attach an optimizer created after ``initialize``: loss scaling, and FP32
    masters under O2/O5. A no-op for an optimizer already attached.

    Args:
        optimizer: the new optimizer; under O2/O5 its parameters must belong
            to the models passed to ``initialize``.

    Returns:
        ``optimizer``, now patched like those passed to ``initialize``.

    Raises:
        StateError: before ``initialize``.
        ConfigError: the optimizer does not fit the opt level (e.g. FP16
            weights at O1, foreign parameters at O2); nothing changed.

    Example::

        model = amp_patch.initialize(model, opt_level="O1")
        optimizer = amp_patch.adopt_optimizer(torch.optim.AdamW(model.parameters()))
    """
    from .. import frontend
    from ..precision import model as model_side

    with frontend._lock:
        amp = _current("adopt_optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"adopt_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        h = amp.optimizer_handles.get(id(optimizer))
        if h is not None and h.optimizer is optimizer and h.patched:
            return optimizer
        # the first initialize's fused_update applies to an adopted optimizer; no models come with it
        options = dataclasses.replace(amp.options, keep_fp32=None)
        model_side.validate([], [optimizer], amp.props, options, amp)
        mark = amp.undo.mark()
        try:
            model_side.attach(amp, [], [optimizer], options)
            attach(amp, [optimizer])
            amp.extend(amp.optimizers, [optimizer])
        except BaseException:
            amp.undo.pop_to(mark)
            raise
        return optimizer


# ------------------------------------------------------------------ state and counters

STATE_VERSION = 1


def state_dict(destination: Optional[dict] = None) -> dict:
    """amp_patch's state for a checkpoint: every loss scaler and the opt level.

    The format is apex.amp's, ``{"loss_scaler0": {"loss_scale": ...,
    "unskipped": ...}, ...}``, each entry with the scaler's other counters
    added, plus ``"amp_patch": {"version", "opt_level", "half_dtype"}``. Save it
    next to ``model.state_dict()`` and ``optimizer.state_dict()``; loading all
    three after ``initialize`` resumes bit for bit.

    Args:
        destination: a dict to fill and return (apex.amp's argument).

    Example::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp_patch.state_dict()}, "ckpt.pt")
    """
    amp = _current("state_dict")
    out = {} if destination is None else destination
    for i, s in enumerate(_run(amp).scalers):
        out[f"loss_scaler{i}"] = s.state_dict()
    out["amp_patch"] = {
        "version": STATE_VERSION,
        "opt_level": amp.props.opt_level,
        "half_dtype": str(amp.props.half_dtype).replace("torch.", ""),
    }
    return out


def _scaler_entries(state: dict) -> List[Any]:
    keys = [k for k in state if isinstance(k, str) and k.startswith("loss_scaler")]
    ids = sorted(int(k[11:]) for k in keys if k[11:].isdigit())
    if not keys:
        raise ConfigError(
            f"amp_patch.load_state_dict: no loss scaler state in the dict (keys: {sorted(map(str, state))}); "
            f"pass what amp_patch.state_dict() (or apex.amp.state_dict()) returned"
        )
    if len(ids) != len(keys) or ids != list(range(len(ids))):
        raise ConfigError(f"amp_patch.load_state_dict: expected keys loss_scaler0..loss_scaler{len(keys) - 1}, got {sorted(keys)}")
    return [state[f"loss_scaler{i}"] for i in ids]


def load_state_dict(state: dict, *, strict: bool = True) -> None:
    """Restore ``state_dict()`` output, or apex.amp's (``{"loss_scaler0": {...}}``).

    Call it after ``initialize`` with the same ``num_losses``. All or
    nothing: a bad entry raises before any scaler changes.

    Args:
        state: what ``state_dict()`` returned.
        strict: False loads a checkpoint with another number of loss scalers
            as apex.amp did: a warning, then the first ``min(saved, num_losses)``
            scalers (``apex.amp.load_state_dict`` here uses it).

    Raises:
        StateError: before ``initialize``.
        ConfigError: malformed state, or (when strict) a different number of losses.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2")
        ckpt = torch.load("ckpt.pt")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        amp_patch.load_state_dict(ckpt["amp"])
    """
    import copy

    amp = _current("load_state_dict")
    if not isinstance(state, dict):
        raise ConfigError(f"amp_patch.load_state_dict expects the dict amp_patch.state_dict() returned, got {type(state).__name__}")
    entries = _scaler_entries(state)
    run = _run(amp)
    if len(entries) != len(run.scalers):
        message = (
            f"amp_patch.load_state_dict: the checkpoint has {len(entries)} loss scaler(s), this run has "
            f"{len(run.scalers)}; pass initialize(..., num_losses={len(entries)})"
        )
        if strict:
            raise ConfigError(message)
        diagnostics.warn_user(f"{message}. Loading the first {min(len(entries), len(run.scalers))}, as apex.amp did.")
    meta = state.get("amp_patch")
    level = meta.get("opt_level") if isinstance(meta, dict) else None
    half = meta.get("half_dtype") if isinstance(meta, dict) else None
    for i, (s, entry) in enumerate(zip(run.scalers, entries)):
        try:
            copy.deepcopy(s).load_state_dict(entry)
        except ValueError as e:
            raise ConfigError(f"amp_patch.load_state_dict: loss scaler {i}: {e}") from None
    notes = []
    ours = str(amp.props.half_dtype).replace("torch.", "")
    if half is not None and half != ours:
        notes.append(f"the checkpoint was saved by a {half} run and this run is {ours}")
    if level is not None and level != amp.props.opt_level:
        notes.append(f"the checkpoint was saved at opt_level={level!r} and this run is {amp.props.opt_level!r}")
    for i, (s, entry) in enumerate(zip(run.scalers, entries)):
        notes += [f"loss scaler {i}: {n}" for n in s.load_state_dict(entry)]
    if notes:
        diagnostics.warn_user("amp_patch.load_state_dict: " + "; ".join(notes) + ".")
    ensure_patches(amp)  # a static scale of 1 may have become another


def counters() -> Dict[str, Any]:
    """Steps taken and skipped, and each loss's scale.

    Returns:
        ``{"steps": int, "skipped": int, "loss_scale": [float per loss],
        "losses": [{"loss_scale", "steps", "skipped", "growth_tracker"}],
        "optimizers": [{"steps", "skipped", "fused"}]}``; ``steps`` and
        ``skipped`` sum the optimizers' ``step()`` calls that ran and that
        were skipped; ``fused`` counts the steps the fused update ran (under
        ``fused_update=True``; the rest were plain O2 steps).

    Example::

        c = amp_patch.counters()
        print(f"skipped {c['skipped']} of {c['steps'] + c['skipped']} steps; scale {c['loss_scale'][0]:g}")
    """
    amp = _current("counters")
    run = _run(amp)
    opts = [{"steps": h.steps, "skipped": h.skipped, "fused": h.fused.steps if h.fused is not None else 0}
            for h in run.handles]
    return {
        "steps": sum(o["steps"] for o in opts),
        "skipped": sum(o["skipped"] for o in opts),
        "loss_scale": [s.scale for s in run.scalers],
        "losses": [
            {"loss_scale": s.scale, "steps": s.steps, "skipped": s.skipped, "growth_tracker": s.growth_tracker}
            for s in run.scalers
        ],
        "optimizers": opts,
    }
