"""The per-optimizer state machine of loss scaling, and one run's scalers.

Each optimizer amp_patch attached has a ``Handle`` whose ``stage`` says where
its gradients are (``Stage``). The rule every path keeps: **no scaled gradient
outlives the backward that made it.** At the end of every scaled backward (a
patched ``loss.backward()``, the exit of ``scale_loss``) ``transfer`` unscales
the gradients in place (into the FP32 masters under O2) and folds their
inf/NaN check into a flag kept on the device, so code that reads ``.grad``
before the step sees true gradients, as it did under Apex, with no host sync
per backward. The step asks for the skip decision.

**Sync-free steps** (``sync_free=True``, the default). The decision stays on
the device: each loss's verdict is a 0-d flag there, its scaler moves on the
device (``LossScaler.update_device``), and each optimizer gets its own flag in
``Handle.skip``. A step whose update can take the flag (the one-pass C step,
torch's ``fused=True`` optimizers, which read ``found_inf`` as under
``GradScaler``) leaves parameters and state untouched when it is set, and no
step waits for the device. Any other step reads its flag on the host: one sync
(``scaling.optimizer``). Overflow notices, the skip limit and the counters
follow from records the device posts to the host (``LossScaler.poll``): on the
CPU at once, on a GPU a step or so later; reading a counter waits for them.
With ``sync_free=False`` the decision is read on the host, one sync per step
for every loss together.

Gradients a later scaled backward would add to are true already, so they are
set aside (``parked``) while it runs and added back once its own are
unscaled: whatever mixes in ``.grad`` (another loss, a backward amp_patch did
not scale) is never divided by a scale it was not multiplied by. Under
``torch.distributed`` the running sum must stay where DDP's all-reduce reads
it, in the model's ``.grad``: an O1 sum is multiplied by the scale again
before the next scaled backward instead of parked (exact: the scale is a
power of two), and an O2 sum stays scaled in the half model, the FP32 masters
holding its unscaled copy after every backward. ``scale_loss(...,
delay_unscale=True)`` keeps Apex's meaning: that exit leaves the gradients
``SCALED`` for a later exit of the same loss to unscale once.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import diagnostics
from ..base.counts import DeviceCount
from ..base.errors import OverflowLoopError, StateError
from ..config import AmpConfig
from ..precision import fsdp, master
from .scaler import LossScaler

if TYPE_CHECKING:
    from ..precision.compiled import CompiledUpdate
    from ..precision.onepass import OnePassStep

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
_CPU = torch.device("cpu")

class Stage(enum.Enum):
    """Where an attached optimizer's gradients are, as torch's ``OptState`` is for ``GradScaler``."""

    READY = "ready"  # none amp_patch knows of: before the first backward, after zero_grad or a fused step
    SCALED = "scaled"  # a scaled backward left them (``Handle.loss`` says whose scale); not usable yet
    UNSCALED = "unscaled"  # true gradients (in the FP32 masters under O2), checked for inf/NaN


#: the moves each stage allows; anything else is a bug in amp_patch, refused
MOVES = {
    Stage.READY: frozenset({Stage.READY, Stage.SCALED}),
    Stage.SCALED: frozenset({Stage.SCALED, Stage.UNSCALED, Stage.READY}),
    Stage.UNSCALED: frozenset({Stage.READY, Stage.SCALED}),
}


class Handle:
    """What amp_patch keeps for one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, run: "LossScaling"):
        self.optimizer = optimizer
        self.run = run
        self.masters: Optional[master.MasterWeights] = None
        self.compiled: Optional[CompiledUpdate] = None  # compiled.CompiledUpdate under fused_update=True
        self.onepass: Optional[OnePassStep] = None  # onepass.OnePassStep: the one-pass step (O1/O2/O4/O5), where it is built
        self.patched = False
        self.saved: Dict[str, object] = {}  # replaced instance attributes: name -> own value or _NOTSET
        self.originals: Dict[str, Callable[..., Any]] = {}  # name -> the callable we call through
        self.stage = Stage.READY
        self.loss: Optional[int] = None  # the loss whose scale the SCALED gradients carry
        self.parked: Optional[List[Tuple[Tensor, Tensor]]] = None  # (param, true grad) parked during a scaled backward
        self.fed_by: set = set()  # the checks of the backwards that fed this optimizer since the last skip decision
        #: the skip decision waiting for this optimizer's step: a bool, or under
        #: sync-free steps the 0-d device flag (1.0: skip)
        self.skip: Union[None, bool, Tensor] = None
        #: whether the optimizer's step skips on a ``found_inf`` attribute (``steps``; None: not asked yet)
        self.reads_found_inf: Optional[bool] = None
        self.calls = 0  # calls of step(), taken or skipped
        self._skipped = DeviceCount()  # skips decided on the device are counted there

    def count(self, skipped: Union[bool, Tensor]) -> None:
        """Count one call of the optimizer's ``step()``, taken or ``skipped`` (a
        device flag: counted there, read when asked), and, once per round, the
        losses whose scale is inactive (``LossScaling.count_unscaled``)."""
        self.calls += 1
        self._skipped.add(skipped if isinstance(skipped, Tensor) else int(bool(skipped)))
        self.run.count_unscaled(self)

    @property
    def skipped(self) -> int:
        """Calls of ``step()`` skipped for inf/NaN gradients (a count kept on the device is read: a sync when asked)."""
        return self._skipped.value

    @property
    def steps(self) -> int:
        """Calls of ``step()`` taken."""
        return self.calls - self.skipped

    def move(self, stage: Stage, loss: Optional[int] = None) -> None:
        """Go to ``stage`` (``loss``: the loss of a scaled backward); StateError for a move ``MOVES`` lacks."""
        if stage not in MOVES[self.stage]:
            raise StateError(
                f"amp_patch: {type(self.optimizer).__name__}'s gradients cannot go from {self.stage.value} to "
                f"{stage.value}; this is a bug in amp_patch, please report it with the training loop"
            )
        self.stage = stage
        self.loss = loss if stage is Stage.SCALED else None

    @property
    def pending(self) -> Optional[int]:
        """The loss whose scaled gradients await ``transfer``, or None."""
        return self.loss if self.stage is Stage.SCALED else None

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
        if not self.verbosity or not is_rank0():
            return
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval:
            self.suppressed += 1
            return
        if self.suppressed:
            text += f" ({self.suppressed} more overflow messages suppressed)"
        self.last, self.suppressed = now, 0
        log.warning(text)


class Hooks:
    """What loss scaling needs from the rest of a session, handed in by whoever
    composes it (``run.session``): nothing else of the session is reachable from here."""

    def __init__(self, flight: Any = None, on_skip: Optional[Callable[[int, LossScaler], None]] = None,
                 models: Callable[[], Sequence[torch.nn.Module]] = tuple,
                 dtypes_before: Callable[[], Dict[int, torch.dtype]] = dict,
                 record_loss: Callable[[Tensor, int, int], None] = lambda loss, loss_id, step: None,
                 clear_cache: Callable[[], None] = lambda: None, live: Callable[[], bool] = lambda: True,
                 patch: Callable[[Sequence[Any]], None] = lambda items: None):
        #: the session's work in flight (``base.inflight.InFlight``): the patched step enters it
        self.flight = flight
        #: told of each skipped step (overflow provenance, ``diagnostics``)
        self.on_skip = on_skip
        #: the session's models (a backward's own leaves are theirs)
        self.models = models
        #: a converted parameter's dtype before ``initialize``, by id (``add_param_group``)
        self.dtypes_before = dtypes_before
        #: keeps the true loss of a plain backward (``record_loss(loss, loss_id, step)``, for plot())
        self.record_loss = record_loss
        #: empties the cast cache (around every backward)
        self.clear_cache = clear_cache
        #: whether the session is still the running one (a patch called after it passes through)
        self.live = live
        #: patches torch's functions for the session, all or nothing, with their undo
        self.patch = patch


class LossScaling:
    """The loss-scaling state of one session: the loss scalers, one ``Handle`` per
    attached optimizer, this step's checks and flags.

    Built once per session from its config (``configure`` takes the scaler
    settings, ``sync_free`` and ``verbosity``) and the device type; ``hooks``
    is all it sees of the rest of the session.
    """

    def __init__(self, config: AmpConfig, device_type: str, hooks: Optional[Hooks] = None):
        self.device_type = device_type
        self.hooks = hooks if hooks is not None else Hooks()
        self.by_optimizer: Dict[int, Handle] = {}  # id(optimizer) -> its handle (attached or being attached)
        self.scalers: List[LossScaler] = []
        self.max_skips: Optional[int] = None
        self.handles: List[Handle] = []  # patched, in attach order: what a plain backward feeds
        # One check per scaled backward (Apex decided per scale_loss exit which
        # optimizers skip): check id -> its loss, and (check, device) -> its inf/NaN flag
        self.checks: Dict[int, int] = {}
        self.found: Dict[Tuple[int, torch.device], Tensor] = {}
        self.checked: set = set()  # losses checked since the last skip decision
        self.foreign: Dict[int, List[int]] = {}  # loss -> checks of foreign leaves, for the backward's optimizers
        self._next_check = 0
        self.inv: Dict[Tuple[int, torch.device], Tuple[float, Tensor]] = {}
        self.undecided = False  # something awaits a transfer or a skip decision
        self.plain = False  # the patched backward has work to do
        self.notices = _Notices(config.verbosity)
        self.warned_foreign = False  # said once that a backward reached an unattached optimizer's parameters
        self.warned_grad_scaler = False  # said once that a GradScaler of the script's scales a loss too
        self.round: set = set()  # ids of the handles that stepped in this round (``count_unscaled``)
        self.configure(config)

    @property
    def home(self) -> torch.device:
        """Where the scale lives and the verdicts are gathered."""
        if self.device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        """The FP32 master of a model parameter, or None."""
        for h in self.by_optimizer.values():
            if h.masters is not None:
                m = h.masters.master_of(param)
                if m is not None:
                    return m
        return None

    def handle_of(self, optimizer: torch.optim.Optimizer) -> Optional["Handle"]:
        """``optimizer``'s handle while it is attached, else None."""
        h = self.by_optimizer.get(id(optimizer))
        return h if h is not None and h.optimizer is optimizer and h.patched else None

    def handle(self, optimizer: torch.optim.Optimizer, undo: Any) -> "Handle":
        """``optimizer``'s handle, made on first use (not patched yet); its undo goes on ``undo``."""
        h = self.by_optimizer.get(id(optimizer))
        if h is None or h.optimizer is not optimizer:
            h = self.by_optimizer[id(optimizer)] = Handle(optimizer, self)
            undo.push(_DropHandle(self, optimizer))
        return h

    def reconfigure(self, config: AmpConfig, undo: Any, scalers: Optional[List[LossScaler]] = None) -> None:
        """Take ``config``'s session options, with ``scalers`` (else new ones), pushing
        the undo that brings back the scalers and settings of now."""
        undo.push(_Restore(self, self.config))
        self.configure(config, scalers)

    def grow(self, n: int, config: AmpConfig, undo: Any) -> None:
        """At least ``n`` loss scalers (Apex's ``wrap_optimizer(num_loss=n)``): the new
        ones start from ``config`` (the session's, with ``num_losses=n``)."""
        if len(self.scalers) < n:
            self.reconfigure(config, undo, self.scalers + [self.new_scaler(config) for _ in range(n - len(self.scalers))])

    def new_scaler(self, config: AmpConfig) -> LossScaler:
        return LossScaler.from_config(config.scaler)

    def configure(self, config: AmpConfig, scalers: Optional[List[LossScaler]] = None) -> None:
        """Take the session's settings: the loss scalers (``scalers``, else
        ``config.scaler.num_losses`` new ones), the skip limit, the notices' verbosity."""
        self.config = config
        self.scalers[:] = scalers if scalers is not None else [self.new_scaler(config) for _ in range(config.scaler.num_losses)]
        self.sync_free = config.sync_free
        for s in self.scalers:
            if self.sync_free and s.active:
                s.to_device(self.home)
            else:
                s.to_host()
        self.max_skips = config.scaler.max_consecutive_skips
        self.notices.verbosity = config.verbosity
        self.refresh_plain()

    def count_unscaled(self, h: Handle) -> None:
        """A step of every loss whose scaler is inactive (BF16, a static 1.0), once per round.

        No skip decision is taken for such a loss, and nothing records which
        optimizers it fed, so its steps are counted in rounds of optimizer
        steps: a round starts at the first step, and again whenever an
        optimizer that already stepped in it steps again. That is one step per
        training iteration when each optimizer steps once per iteration, as
        an active scaler counts one skip decision per iteration.
        """
        if not self.round or id(h) in self.round:
            self.round.clear()
            for s in self.scalers:
                if not s.active:
                    s.update(False)
        self.round.add(id(h))

    def refresh_plain(self) -> None:
        self.plain = bool(self.handles) and (
            self.scalers[0].active or any(h.masters is not None and len(h.masters) for h in self.handles)
        )

    def new_check(self, loss_id: int) -> int:
        """A new inf/NaN check of loss ``loss_id``'s gradients, decided at the next skip decision."""
        cid = self._next_check
        self._next_check += 1
        self.checks[cid] = loss_id
        self.checked.add(loss_id)
        return cid

    def unscaler(self, loss_id: int) -> Optional["_Unscale"]:
        """``unscale(tensors)`` for loss ``loss_id`` under a new check, or None when it is not scaled."""
        if not self.scalers[loss_id].active:
            return None
        return _Unscale(self, self.new_check(loss_id), loss_id)

    def found_flag(self, check: int, device: torch.device) -> Tensor:
        """The inf/NaN flag of ``check`` on ``device`` (> 0: found), kept on the device."""
        found = self.found.get((check, device))
        if found is None:
            found = self.found[(check, device)] = torch.zeros((), dtype=torch.float32, device=device)
        return found

    def inv_scale(self, loss_id: int, device: torch.device) -> Tensor:
        """``1 / scale`` of loss ``loss_id`` as a 0-d FP32 tensor on ``device``: the
        scaler's own on the device (sync-free), else made once per host scale."""
        scaler = self.scalers[loss_id]
        if scaler.device is not None:
            return scaler.inv_tensor(device)
        scale = scaler.scale
        cached = self.inv.get((loss_id, device))
        if cached is None or cached[0] != scale:
            cached = self.inv[(loss_id, device)] = (scale, torch.full((), 1.0 / scale, dtype=torch.float32, device=device))
        return cached[1]


def _dense_real(t: Tensor) -> Tensor:
    """What the fused unscale-and-check can take of a gradient, sharing its memory:
    a DTensor's local shard (FSDP2: each rank checks its own, and the skip
    decision is all-reduced), a sparse gradient's values (as
    ``torch.amp.GradScaler`` unscales them; the ones unscaled here are FP32, so
    summing duplicates cannot overflow) and a complex gradient's real view."""
    if type(t) is not Tensor:
        t = fsdp.local(t)
    if t.is_sparse:
        t = t._values()
    return torch.view_as_real(t) if t.is_complex() else t


def loss_factor(scaler: LossScaler, loss: Tensor) -> Union[float, Tensor]:
    """What a loss is multiplied by: the scale on the loss's device (sync-free), else the host float."""
    return scaler.scale_tensor(loss.device) if scaler.device is not None else scaler.scale


class _Unscale:
    """Unscale tensors in place for one loss, folding inf/NaN into one check's flag."""

    def __init__(self, run: LossScaling, check: int, loss_id: int):
        self.run, self.check, self.loss_id = run, check, loss_id

    def cpu_args(self) -> Tuple[Union[float, Tensor], int]:
        """``(1 / scale, address of the CPU inf/NaN flag)``: what the C routine that
        unscales and checks CPU gradients as it moves them takes (``precision.master``);
        under sync-free steps the inverse is the scaler's CPU tensor, which the C reads."""
        flag = self.run.found_flag(self.check, _CPU)
        scaler = self.run.scalers[self.loss_id]
        inv = scaler.inv_tensor(_CPU) if scaler.device is not None else 1.0 / scaler.scale
        return inv, flag.data_ptr()

    def __call__(self, tensors: List[Tensor]) -> None:
        by_device: Dict[torch.device, List[Tensor]] = {}
        for t in tensors:
            t = _dense_real(t)
            by_device.setdefault(t.device, []).append(t)
        run, l = self.run, self.loss_id
        for dev, ts in by_device.items():
            torch._amp_foreach_non_finite_check_and_unscale_(ts, run.found_flag(self.check, dev), run.inv_scale(l, dev))


class _DropHandle:
    """Undo of ``LossScaling.handle``: the optimizer's record out of the session."""

    def __init__(self, scaling: "LossScaling", optimizer: torch.optim.Optimizer):
        self.scaling, self.key = scaling, id(optimizer)

    def __call__(self) -> None:
        self.scaling.by_optimizer.pop(self.key, None)


def distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def is_rank0() -> bool:
    return not distributed() or torch.distributed.get_rank() == 0


# ------------------------------------------------------------------ the state machine


def transfer(run: LossScaling, h: Handle) -> None:
    """Make ``h``'s gradients true gradients where its optimizer reads them.

    Every handle pending on the same loss is transferred with it, so a
    parameter two optimizers share is unscaled once; under O2 half gradients
    an untouched backward left join the masters. Device work only. Idempotent.
    """
    if h.pending is not None:
        transfer_group(run, [x for x in run.handles if x.pending == h.pending and x is not h] + [h])
    _absorb(h)


def _absorb(h: Handle) -> None:
    if h.masters is not None and len(h.masters) and not distributed():
        h.masters.absorb_true_grads()


def transfer_group(run: LossScaling, handles: Sequence[Handle], armed: Optional["Armed"] = None) -> None:
    """Unscale the pending gradients of ``handles`` (each tensor once), into the
    masters under O2, and fold their inf/NaN check into this step's flag
    (``armed``: the backward that just ended moved gradients as they arrived,
    under that check)."""
    by_loss: Dict[int, List[Handle]] = {}
    for h in handles:
        if h.pending is not None and h not in by_loss.get(h.pending, ()):
            by_loss.setdefault(h.pending, []).append(h)
    keep = distributed()
    for l, group in by_loss.items():
        unscale = armed.unscale if armed is not None and armed.loss_id == l else run.unscaler(l)
        seen: set = set()
        grads: List[Tensor] = []
        for h in group:
            if unscale is not None:
                h.fed_by.add(unscale.check)
            if h.masters is not None and len(h.masters):
                h.masters.collect_grads(unscale, keep_half=keep)
            for p in h.own_params():
                g = p.grad
                if g is not None and id(g) not in seen:
                    seen.add(id(g))
                    grads.append(g)
        if unscale is not None and grads:
            unscale(grads)
        for h in group:
            if h.parked:
                _unpark(h)
            h.move(Stage.UNSCALED)


def _unpark(h: Handle) -> None:
    with torch.no_grad():
        back = [(p, g) for p, g in h.parked if p.grad is not None]
        if back:
            torch._foreach_add_([p.grad for p, _ in back], [g for _, g in back])
        for p, g in h.parked:
            if p.grad is None:
                p.grad = g
    h.parked = None


def transfer_all(run: LossScaling) -> None:
    transfer_group(run, run.handles)
    for h in run.handles:
        _absorb(h)


def _park_true_grads(h: Handle) -> None:
    """Set aside the true gradients of ``h``'s own parameters while a scaled backward adds new ones."""
    parked = []
    for p in h.own_params():
        if p.grad is not None:
            parked.append((p, p.grad))
            p.grad = None
    if parked:
        h.parked = (h.parked or []) + parked


def _rescale_true_grads(h: Handle, scaler: LossScaler) -> None:
    """Under DDP: multiply the running sum in ``.grad`` by the scale, so the next
    scaled backward adds to it and the all-reduce sees the whole sum (under
    FSDP2, the sharded sum its reduce-scatter adds to)."""
    grads = [fsdp.local(p.grad) for p in h.own_params() if p.grad is not None and not p.grad.is_sparse]
    if grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, loss_factor(scaler, grads[0]))


def before_backward(run: LossScaling, handles: Sequence[Handle], loss_id: int) -> None:
    """Get gradients ready for a backward of ``loss_id`` into ``handles``.

    Gradients a ``delay_unscale`` exit left scaled by this same loss keep
    accumulating where autograd puts them (a single process moves O2's half
    gradients into the FP32 masters first, so accumulation happens in FP32);
    those of another loss are unscaled before they could mix. Every other
    gradient is true already: a single process parks it, DDP multiplies it by
    the scale again (see the module docstring). Under O2 a half gradient an
    untouched backward left in the model joins the masters as it is.
    """
    scaler = run.scalers[loss_id]
    scaled = scaler.active
    dist = distributed()
    for h in handles:
        has_masters = h.masters is not None and len(h.masters)
        if h.fed_by and not dist:
            _forget_dropped(h)
        if h.pending is not None:
            if h.pending == loss_id and (dist or not has_masters):
                continue
            transfer(run, h)
        else:
            _absorb(h)
        if has_masters:
            if dist:
                h.masters.model_view.rescale(loss_factor(scaler, h.masters.masters[0]) if scaled else 1.0)
            else:
                h.masters.model_view.drop()
        if h.stage is Stage.SCALED or not scaled:
            continue
        if dist:
            _rescale_true_grads(h, scaler)
            h.move(Stage.SCALED, loss_id)
        else:
            _park_true_grads(h)


def _forget_dropped(h: Handle) -> None:
    """Gradients the script threw away since their backward (``model.zero_grad()``
    after a NaN loss, with no step) take their overflow verdict with them: the
    next step is decided by the backwards whose gradients it applies. The loss
    scale still backs off for the overflow at the next decision."""
    if h.masters is not None:
        h.masters.model_view.take()
    if any(p.grad is not None for g in h.optimizer.param_groups for p in g["params"]):
        return
    h.fed_by.clear()
    h.skip = None


class Armed:
    """The masters of one backward that take each half gradient as autograd finishes it,
    and the inf/NaN check they fold it into (``unscale``; None when the loss is not scaled)."""

    def __init__(self, loss_id: int, unscale: Optional[_Unscale], masters: List[master.MasterWeights]):
        self.loss_id, self.unscale, self.masters = loss_id, unscale, masters

    def disarm(self) -> None:
        for mw in self.masters:
            mw.early_moves.disarm()


def arm(run: LossScaling, handles: Sequence[Handle], loss_id: int) -> Optional[Armed]:
    """Before a backward of ``loss_id`` whose end unscales (no ``delay_unscale``): have
    the masters of ``handles`` take each half gradient, unscaled and checked, as soon
    as autograd finishes it (``EarlyMoves.arm``), so the model's half gradients and
    the masters' FP32 ones are not all alive together. A single process on the CPU
    only: DDP's all-reduce reads the half gradients after the backward. Returns what
    ``after_backward`` needs, or None when nothing was armed."""
    if distributed():
        return None
    mws = [h.masters for h in handles if h.masters is not None and h.masters.early_moves.can_arm()]
    if not mws:
        return None
    unscale = run.unscaler(loss_id)
    inv, found = unscale.cpu_args() if unscale is not None else (1.0, 0)
    for mw in mws:
        mw.early_moves.arm(inv, found)
    return Armed(loss_id, unscale, mws)


def after_backward(run: LossScaling, handles: Sequence[Handle], loss_id: int, delay_unscale: bool = False,
                   armed: Optional[Armed] = None) -> None:
    """After a backward of ``loss_id`` into ``handles``: unscale and check its
    gradients now, unless ``delay_unscale`` leaves that to a later exit
    (``armed``: what ``arm`` made before it; disarmed here)."""
    if armed is not None:
        armed.disarm()
    if not run.scalers[loss_id].active and not any(h.masters is not None and len(h.masters) for h in handles):
        return
    foreign = run.foreign.pop(loss_id, ())
    for h in handles:
        h.move(Stage.SCALED, loss_id)
        h.fed_by.update(foreign)
    run.undecided = True
    if not delay_unscale:
        transfer_group(run, handles, armed)


def decide_skips(run: LossScaling) -> None:
    """Transfer everything pending and decide, with one host sync, which steps to skip."""
    if not run.undecided:
        return
    transfer_all(run)
    overflow: Dict[int, bool] = {}
    bad: Dict[int, bool] = {}  # check -> overflowed
    stuck: List[int] = []
    if run.checks:
        scalers = run.scalers
        dev = next(iter(run.found))[1] if run.found else run.home
        per_check = {c: torch.zeros((), device=dev) for c in run.checks}
        for (c, d), f in run.found.items():
            per_check[c] = per_check[c] + f.to(dev)
        if run.sync_free:
            stuck = _decide_on_device(run, per_check, dev)
            for h in run.handles:
                if h.fed_by:
                    h.skip = _flag_of(h.fed_by, per_check)
                    h.fed_by.clear()
            run.found.clear()
            run.checks.clear()
            run.checked.clear()
            run.undecided = False
            if stuck:
                _raise_stuck(run, stuck[0])
            return
        if distributed():
            # every rank reaches this point once per step, so the collective pairs
            # up; per loss, since ranks need not run the same number of backwards
            per_loss = [torch.zeros((), device=dev) for _ in scalers]
            for c, f in per_check.items():
                per_loss[run.checks[c]] = per_loss[run.checks[c]] + f
            flags = torch.stack(per_loss)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            by_loss = flags.tolist()  # the one host sync of the step
            bad = {c: by_loss[l] > 0 for c, l in run.checks.items()}
        else:
            cids = list(per_check)
            values = torch.stack([per_check[c] for c in cids]).tolist()  # the one host sync of the step
            bad = {c: v > 0 for c, v in zip(cids, values)}
        for l in sorted(run.checked):
            overflow[l] = any(bad[c] for c, cl in run.checks.items() if cl == l)
        run.found.clear()
        run.checks.clear()
        run.checked.clear()
        for l, is_bad in overflow.items():
            s = scalers[l]
            before = s.scale
            s.update(is_bad)
            if is_bad:
                _on_overflow(run, l, s, before, s.scale)
                if run.max_skips is not None and s.skips_at_min >= run.max_skips:
                    stuck.append(l)
    for h in run.handles:
        if h.fed_by:
            h.skip = any(bad.get(c, False) for c in h.fed_by)
            h.fed_by.clear()
    run.undecided = False
    if stuck:
        _raise_stuck(run, stuck[0])


def _decide_on_device(run: LossScaling, per_check: Dict[int, Tensor], dev: torch.device) -> List[int]:
    """The sync-free decision: each check's flag made 0/1 in ``per_check`` (under
    ``torch.distributed``, its loss's flag over every rank), each checked loss's
    scaler moved on the device, and the records that reached the host replayed
    (notices, the skip limit). Returns the losses stuck at the skip limit."""
    by_loss: Dict[int, List[int]] = {}  # loss -> its checks
    for c in per_check:
        by_loss.setdefault(run.checks[c], []).append(c)
    if distributed():
        # every rank reaches this point once per step, so the collective pairs up
        flags = torch.stack([torch.stack([per_check[c] for c in by_loss[l]]).amax() if l in by_loss
                             else torch.zeros((), device=dev) for l in range(len(run.scalers))])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        flags.clamp_(max=1.0)
        loss_flag = {l: flags[l] for l in by_loss}
        for c in per_check:
            per_check[c] = loss_flag[run.checks[c]]
    else:
        for c, f in per_check.items():
            per_check[c] = f.clamp(max=1.0)  # several devices' flags add up
        # each loss's flag: the largest of its checks' (0/1 already)
        loss_flag = {l: per_check[cs[0]] if len(cs) == 1 else torch.stack([per_check[c] for c in cs]).amax()
                     for l, cs in by_loss.items()}
    stuck = []
    for l in sorted(run.checked):
        if l in loss_flag:
            if run.scalers[l].device is None:
                run.scalers[l].to_device(dev)  # a scale set since configure turned scaling on
            run.scalers[l].update_device(loss_flag[l])
    for l, s in enumerate(run.scalers):
        for before, after in s.poll():
            _on_overflow(run, l, s, before, after)
        if s.device is not None and run.max_skips is not None and s.seen("skips_at_min") >= run.max_skips:
            stuck.append(l)
    return stuck


def _flag_of(checks: set, flags: Dict[int, Tensor]) -> Optional[Tensor]:
    """One optimizer's skip flag: the largest of its checks' (0/1, on the device)."""
    fs = [flags[c] for c in checks if c in flags]
    if not fs:
        return None
    return fs[0] if len(fs) == 1 else torch.stack(fs).amax()


def _raise_stuck(run: LossScaling, l: int) -> None:
    s = run.scalers[l]
    raise OverflowLoopError(
        f"loss {l}: the last {s.seen('skips_at_min')} steps all produced inf/NaN gradients with the loss scale "
        f"already at its minimum ({s.seen('scale'):g}), so every step was skipped. Some op overflows even "
        f"unscaled: find it with initialize(..., find_overflow=True), move it to FP32 with an op-list "
        f"override (lists={{'torch': {{'float': ['op_name']}}}}), train in BF16 "
        f"(half_dtype=torch.bfloat16), or lower the learning rate. "
        f"(max_consecutive_skips={run.max_skips} sets this limit.)"
    )


def settle(run: "LossScaling") -> None:
    """Before the session ends: make every gradient a scaled backward left a
    true gradient, or drop it.

    The ``optimizer.step()`` after ``deinitialize`` is torch's own and cannot be
    skipped, so gradients that overflowed are set to None (a parameter with no
    gradient is not stepped) and one warning says so: the step then changes
    nothing, as amp_patch's skipped step would have.
    """
    try:
        decide_skips(run)
    except OverflowLoopError:
        pass  # the skip decisions are set; the session is ending anyway
    dropped = [h for h in run.handles if h.skip]
    for h in dropped:
        for p in h.own_params():
            p.grad = None
        if h.masters is not None:
            for m in h.masters.masters:
                m.grad = None
        h.skip = None
    if dropped and run.notices.verbosity:
        names = ", ".join(type(h.optimizer).__name__ for h in dropped)
        diagnostics.warn_user(
            f"amp_patch.deinitialize(): the last backward produced inf/NaN gradients for {names}, whose step "
            f"amp_patch would have skipped. Those gradients were dropped (set to None), so an optimizer.step() "
            f"after deinitialize changes nothing; run the next backward before stepping."
        )


class _Restore:
    """Undo of ``LossScaling.reconfigure``: the scalers and settings as they were."""

    def __init__(self, scaling: "LossScaling", config: AmpConfig):
        self.scaling, self.config, self.scalers = scaling, config, list(scaling.scalers)

    def __call__(self) -> None:
        self.scaling.configure(self.config, self.scalers)


def restart(run: "LossScaling", config: AmpConfig, undo: Any) -> None:
    """Apex's rule for a later ``amp.initialize``: ``config``'s session-wide
    options are the run's from now on, and the loss scalers start anew from them.

    Gradients a backward left scaled are unscaled and checked first, with the
    scale they were made with, so the next step is right (and skipped if they
    overflowed). Pushes its undo onto ``undo``.
    """
    try:
        decide_skips(run)
    except OverflowLoopError:
        pass  # the skip decision is made; the new scalers start over
    run.reconfigure(config, undo)


def _on_overflow(run: LossScaling, loss_id: int, scaler: LossScaler, before: float, after: float) -> None:
    change = f"loss scale {before:g} -> {after:g}" if after != before else f"loss scale stays {after:g}"
    run.notices.overflow(f"amp_patch: inf/NaN gradients from loss {loss_id}; skipping the step ({change})")
    if run.hooks.on_skip is not None:
        run.hooks.on_skip(loss_id, scaler)
