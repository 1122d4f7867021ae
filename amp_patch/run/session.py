"""The running session: one object while initialized, ``None`` otherwise
(``base.running`` holds which).

A ``Session`` owns everything one ``initialize`` (and any later ones that join
it) changed: function patches, model conversions, optimizer method patches,
the forward tracking hooks, the op ledger, the overflow watch. Each change is
pushed onto the process's undo stack (``base.undo``) under the session's name
as it is made; ``deinitialize`` unwinds the session's entries, newest first,
and a failing ``initialize`` pops them back to the mark it took when it
started (``run.plan``), so the first call and every later one leave nothing
behind.

Every installable piece follows the same protocol: a function that makes its
change and pushes the callable that undoes it (``session.undo.push(undo)``), in
the same step, before anything else can fail.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence

import torch

from .. import diagnostics
from ..base import running
from ..base.undo import Owned
from ..config import AmpConfig
from ..diagnostics import Diagnostics
from ..oplists import Entry
from ..patching.cast import CastCache
from ..patching.spec import Casting
from ..patching.registry import Patcher, PatchItem
from ..patching.wrappers import Live
from ..precision.conversions import Conversions
from ..scaling.state import Hooks, LossScaling
from ..base.inflight import InFlight

if TYPE_CHECKING:
    from ..precision.master import MasterWeights
    from ..scaling.scaler import LossScaler
    from ..scaling.state import Handle


class _SetConfig:
    """Undo of ``Session.set_config``: the settings as they were."""

    def __init__(self, session: "Session", config: AmpConfig):
        self.session, self.config = session, config

    def __call__(self) -> None:
        self.session.config = self.config


class _Trim:
    """Undo of ``Session.extend``: the list back to its old length."""

    def __init__(self, items: List[object], n: int):
        self.items, self.n = items, n

    def __call__(self) -> None:
        del self.items[self.n:]


@dataclasses.dataclass(frozen=True)
class Provisional:
    """What a session the launcher (or ``amp_patch.auto``) started hands on to
    the script's own ``initialize`` that replaces it, unless that call names its own."""

    half_dtype: Optional[torch.dtype] = None
    lists: Optional[Sequence[object]] = None
    cast_model_outputs: Optional[torch.dtype] = None


class Session:
    """What ``initialize`` set up, until ``deinitialize``."""

    def __init__(self, config: AmpConfig, table: Optional[Dict[tuple, Entry]], device_type: str):
        #: the settings of the run: the first initialize's, session-wide options
        #: as Apex's later ``amp.initialize`` calls reset them (``scaling.state.restart``)
        self.config: AmpConfig = config
        #: {(namespace, name): Entry} in force, or None at O0/O2/O3/O5
        self.table: Optional[Dict[tuple, Entry]] = table
        self.device_type: str = device_type
        #: this session's entries on the process's undo stack
        self.undo: Owned = Owned(self)
        #: the registry of patched attributes, each batch pushed onto ``undo``
        self.patcher: Patcher = Patcher(self.undo)
        #: diagnostics: the op ledger (``collect_stats=True``), the loss log, the overflow
        #: watch; it sees of the session only its undo view, patcher and op table, and
        #: the callables handed here
        self.diagnostics: Diagnostics = Diagnostics(
            self.undo, self._config, device_type, patcher=self.patcher, table=table, models=self._models,
            scalers=self._scalers, fp8=self._fp8_rows, collect_stats=config.collect_stats)
        #: what the casting wrappers are built from: the half dtype, the weight-cast
        #: cache, the Live flag (turned off at the end: stray wrappers then call
        #: straight through), the op ledger (the diagnostics' own) and the auto
        #: threshold (set by ``run.plan``)
        self.casting: Casting = Casting(config.half_dtype, Live(), ledger=self.diagnostics.ledger)
        self.flight: InFlight = InFlight()  # forwards, backwards and steps in flight, per thread
        self.models: List[torch.nn.Module] = []
        self.optimizers: List[torch.optim.Optimizer] = []
        #: precision: the model conversions and FP8 layers, and the look-ups their hooks make;
        #: it sees of the session only its undo view and the callables handed here
        self.precision: Conversions = Conversions(
            self.undo, self._config, models=self._models, masters=self._masters, known=self._known,
            attached=self.attached, live=self._live)
        #: loss scaling: the scalers, one handle per attached optimizer, this step's flags;
        #: it sees of the session only what ``Hooks`` hands it
        self.scaling: LossScaling = LossScaling(config, device_type, Hooks(
            flight=self.flight, on_skip=self._on_skip, models=self._models,
            dtypes_before=self.precision.dtypes_before,
            record_loss=self._record_loss, clear_cache=self.cache.clear, live=self._live, patch=self.patch))
        #: set by the launcher (or amp_patch.auto) on the session it started: a
        #: script's own initialize replaces it, keeping these settings
        self.provisional: Optional[Provisional] = None

    @property
    def cache(self) -> CastCache:
        """The half copies of the session's weights (``casting.cache``)."""
        return self.casting.cache

    @property
    def live(self) -> Live:
        """Off once the session is over (``casting.live``)."""
        return self.casting.live

    def holds(self, model: torch.nn.Module) -> bool:
        """True when ``model`` was passed to an ``initialize`` of this session."""
        return any(model is m for m in self.models)

    def handle_of(self, optimizer: torch.optim.Optimizer) -> Optional["Handle"]:
        """``optimizer``'s scaling handle while it is attached (loss scaling, masters), else None."""
        return self.scaling.handle_of(optimizer)

    def set_config(self, config: AmpConfig) -> None:
        """The session's settings from now on (only ``run/`` writes them), and the undo."""
        self.undo.push(_SetConfig(self, self.config))
        self.config = config

    def add_losses(self, n: int) -> None:
        """At least ``n`` loss scalers (Apex's ``wrap_optimizer(num_loss=n)``); the new
        ones start from the session's settings. Pushes the undo."""
        if len(self.scaling.scalers) < n:
            self.set_config(self.config.replace(num_losses=n))
            self.scaling.grow(n, self.config, self.undo)

    # what loss scaling sees of the session (``scaling.state.Hooks``)
    def _on_skip(self, loss_id: int, scaler: "LossScaler") -> None:
        diagnostics.on_skipped_step(self.diagnostics, loss_id, scaler)

    def _models(self) -> List[torch.nn.Module]:
        return self.models

    def _record_loss(self, loss: torch.Tensor, loss_id: int, step: int) -> None:
        diagnostics.record_loss(self.diagnostics, loss, loss_id, step)

    def _live(self) -> bool:
        return running.session() is self

    # what precision sees of the session (``precision.conversions``)
    def _config(self) -> AmpConfig:
        # read at each call: set_config replaces the settings
        return self.config

    # what diagnostics sees of the session (``diagnostics.state``)
    def _scalers(self) -> List["LossScaler"]:
        # read at each call: loss scaling is built after the diagnostics
        return self.scaling.scalers

    def _fp8_rows(self) -> List[Dict[str, Any]]:
        return [row for rec in self.precision.fp8 for row in rec.rows()]

    def _masters(self) -> Iterator["MasterWeights"]:
        for h in self.scaling.by_optimizer.values():
            if h.masters is not None:
                yield h.masters

    def _known(self, optimizer: torch.optim.Optimizer) -> bool:
        # a handle exists from the start of the optimizer's attachment, before its methods are patched
        return id(optimizer) in self.scaling.by_optimizer

    def attached(self, optimizer: torch.optim.Optimizer) -> bool:
        """True when ``optimizer`` is attached to this session."""
        return self.handle_of(optimizer) is not None

    def patch(self, items: Sequence[PatchItem]) -> None:
        """Patch each ``(owner, name, make_wrapper)`` not patched yet, all or nothing, and push the undo."""
        self.patcher.apply(items)

    def unpatch_functions(self) -> None:
        """Take this session's function patches off, keeping the rest of it
        (Apex's ``handle._deactivate()``)."""
        self.patcher.unpatch_all()

    def extend(self, items: List[object], new: Sequence[object]) -> None:
        """Append ``new`` to one of the session's lists, and push the undo."""
        self.undo.push(_Trim(items, len(items)))
        items.extend(new)

    def end(self) -> None:
        """Undo everything, newest first; the session is over even if an undo failed."""
        try:
            self.undo.pop_to(0)
        finally:
            self.live.on = False
            self.cache.clear()
            self.flight.ended = True
            if running.session() is self:
                running.set_session(None)
