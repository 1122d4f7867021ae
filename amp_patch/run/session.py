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
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import torch

from .. import diagnostics
from ..base import running
from ..base.undo import Owned
from ..config import AmpConfig
from ..oplists import Entry
from ..patching.cast import CastCache
from ..patching.registry import Patcher, PatchItem
from ..patching.wrappers import Live
from ..scaling.state import Hooks, LossScaling
from .flight import InFlight

if TYPE_CHECKING:
    from ..diagnostics.stats import Ledger
    from ..precision.fp8 import Fp8Model
    from ..precision.model import Conversion
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
        self.cache: CastCache = CastCache()
        self.live: Live = Live()  # turned off at the end: stray wrappers then call straight through
        self.flight: InFlight = InFlight()  # forwards, backwards and steps in flight, per thread
        self.models: List[torch.nn.Module] = []
        self.optimizers: List[torch.optim.Optimizer] = []
        #: one conversion record per converted or hooked model
        self.model_records: List["Conversion"] = []
        #: O6/O7: one record per model of its FP8 layers (``precision.fp8``)
        self.fp8: List["Fp8Model"] = []
        #: loss scaling: the scalers, one handle per attached optimizer, this step's flags;
        #: it sees of the session only what ``Hooks`` hands it
        self.scaling: LossScaling = LossScaling(config, device_type, Hooks(
            flight=self.flight, on_skip=self._on_skip, models=self._models, dtypes_before=self._dtypes_before,
            record_loss=self._record_loss, clear_cache=self.cache.clear, live=self._live, patch=self.patch))
        self.ledger: Optional["Ledger"] = None  # when collect_stats=True
        #: cast_policy="auto": half-list matmuls under this many FLOPs stay FP32 (0: all cast)
        self.min_flops: float = 0.0
        #: set by the launcher (or amp_patch.auto) on the session it started: a
        #: script's own initialize replaces it, keeping these settings
        self.provisional: Optional[Provisional] = None

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
        diagnostics.on_skipped_step(self, loss_id, scaler)

    def _models(self) -> List[torch.nn.Module]:
        return self.models

    def _record_loss(self, loss: torch.Tensor, loss_id: int, step: int) -> None:
        diagnostics.record_loss(self, loss, loss_id, step)

    def _live(self) -> bool:
        return running.session() is self

    def _dtypes_before(self) -> Dict[int, torch.dtype]:
        # a converted model's parameter comes back from deinitialize in its dtype from before
        return {id(q): d for rec in self.model_records for q, d in rec.params}

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
