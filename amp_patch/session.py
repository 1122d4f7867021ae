"""The running session: one object while initialized, ``None`` otherwise.

A ``Session`` owns everything one ``initialize`` (and any later ones that join
it) changed, and one undo stack that every change pushes onto as it is made:
function patches, model conversions, optimizer method patches, the forward
tracking hooks, the op ledger, the overflow watch. ``deinitialize`` unwinds the
stack, newest first; a failing ``initialize`` pops it back to the mark it took
when it started, so the first call and every later one leave nothing behind.

Every installable piece follows the same protocol: a function that makes its
change and pushes the callable that undoes it (``session.undo.push(undo)``), in
the same step, before anything else can fail.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from .patching.cast import CastCache
from .patching.registry import Patcher
from .inflight import InFlight
from .options import Options
from .properties import Properties
from .patching.wrappers import Live

Undo = Callable[[], None]


class UndoStack:
    """The changes of one session, oldest first, each as the callable that undoes it."""

    def __init__(self) -> None:
        self._entries: List[Undo] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries))

    def push(self, undo: Undo) -> None:
        """Record a change just made, as the callable that undoes it."""
        self._entries.append(undo)

    def mark(self) -> int:
        """Where the stack stands now, for ``pop_to``."""
        return len(self._entries)

    def pop_to(self, mark: int) -> None:
        """Undo every change made since ``mark``, newest first.

        Goes on past a failing undo (a partial undo is the worst outcome) and
        raises the first error at the end.
        """
        errors = []
        while len(self._entries) > mark:
            undo = self._entries.pop()
            try:
                undo()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


class _Trim:
    """Undo of ``Session.extend``: the list back to its old length."""

    def __init__(self, items: List[Any], n: int):
        self.items, self.n = items, n

    def __call__(self) -> None:
        del self.items[self.n:]


class _Unpatch:
    """Undo of ``Session.patch``: that batch of attribute patches off."""

    def __init__(self, patcher: Patcher, n: int):
        self.patcher, self.n = patcher, n

    def __call__(self) -> None:
        # fewer when Apex's handle._deactivate() already took the patches off
        self.patcher.undo(min(self.n, len(self.patcher)))


@dataclasses.dataclass(frozen=True)
class Provisional:
    """What a session the launcher (or ``amp_patch.auto``) started hands on to
    the script's own ``initialize`` that replaces it, unless that call names its own."""

    half_dtype: Any = None
    lists: Any = None
    cast_model_outputs: Any = None


class Session:
    """What ``initialize`` set up, until ``deinitialize``."""

    def __init__(self, props: Properties, table: Optional[dict], device_type: str, options: Options):
        self.props = props
        self.options = options  # amp_patch's own keywords, as the first initialize gave them
        self.table = table  # {(namespace, name): Entry} in force, or None at O0/O2/O3/O5
        self.device_type = device_type
        self.undo = UndoStack()
        self.patcher = Patcher()  # the registry of patched attributes (undone through ``undo``)
        self.cache = CastCache()
        self.live = Live()  # turned off at the end: stray wrappers then call straight through
        self.flight = InFlight()  # forwards, backwards and steps in flight, per thread
        self.models: List[Any] = []
        self.optimizers: List[Any] = []
        self.model_records: List[Any] = []  # one conversion record per converted or hooked model
        self.optimizer_handles: Dict[int, Any] = {}  # id(optimizer) -> scaling.Handle
        self.run: Any = None  # scaling.Run: the loss scalers and this step's flags
        self.scalers: List[Any] = []  # one LossScaler per loss id (the run's)
        self.ledger: Any = None  # stats.Ledger when collect_stats=True
        #: cast_policy="auto": half-list matmuls under this many FLOPs stay FP32 (0: all cast)
        self.min_flops: float = 0.0
        #: set by the launcher (or amp_patch.auto) on the session it started: a
        #: script's own initialize replaces it, keeping these settings
        self.provisional: Optional[Provisional] = None

    def holds(self, model: Any) -> bool:
        """True when ``model`` was passed to an ``initialize`` of this session."""
        return any(model is m for m in self.models)

    def handle_of(self, optimizer: Any) -> Any:
        """``optimizer``'s ``scaling.Handle`` while it is attached (loss scaling, masters), else None."""
        h = self.optimizer_handles.get(id(optimizer))
        return h if h is not None and h.optimizer is optimizer and h.patched else None

    def attached(self, optimizer: Any) -> bool:
        """True when ``optimizer`` is attached to this session."""
        return self.handle_of(optimizer) is not None

    def patch(self, items: list) -> None:
        """Patch each ``(owner, name, make_wrapper)`` not patched yet, all or nothing, and push the undo."""
        n = self.patcher.apply(items)
        if n:
            self.undo.push(_Unpatch(self.patcher, n))

    def extend(self, items: List[Any], new: List[Any]) -> None:
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
            if _current is self:
                set_current(None)


@dataclasses.dataclass(frozen=True)
class Ended:
    """The figures of the last session to end, taken as it ended: what
    ``counters()`` and ``report()`` give after ``deinitialize``."""

    counters: Dict[str, Any]
    report: Any
    #: how many torch functions its op lists patched, per policy (empty at O0/O2/O3/O5)
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)


_current: Optional[Session] = None
_ended: Optional[Ended] = None


def current() -> Optional[Session]:
    """The running session, or None."""
    return _current


def ended() -> Optional[Ended]:
    """The last ended session's figures, or None before any session ended."""
    return _ended


def set_ended(figures: Ended) -> None:
    global _ended
    _ended = figures


def set_current(state: Optional[Session]) -> None:
    global _current
    _current = state
