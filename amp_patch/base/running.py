"""Which session runs now, and the figures of the last one to end.

A slot, not the session itself: the session (``amp_patch.run.session``) is
built from the subpackages, which ask this slot for it, so it lives at the
bottom. Naming the session's type here would point the bottom floor at the
top one, so the slot holds it as ``Any``; a mechanism's module that looks it
up reads the state that mechanism keeps on it (``amp.precision``,
``amp.scaling``, ``amp.diagnostics``) and its settings.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional


@dataclasses.dataclass(frozen=True)
class Ended:
    """The figures of the last session to end, taken as it ended: what
    ``counters()`` and ``report()`` give after ``deinitialize``."""

    counters: Dict[str, object]
    #: its ``diagnostics.report.Report``, a floor above
    report: Any
    #: how many torch functions its op lists patched, per policy (empty at O0/O2/O3/O5)
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)


_session: Any = None  # a run.session.Session, or None
_ended: Optional[Ended] = None


def session() -> Any:
    """The running session (``run.session.Session``), or None."""
    return _session


def set_session(s: Any) -> None:
    """Make ``s`` (a ``run.session.Session``) the running session (None: no session runs)."""
    global _session
    _session = s


def last_ended() -> Optional[Ended]:
    """The last ended session's figures, or None before any session ended."""
    return _ended


def set_ended(figures: Ended) -> None:
    """Keep the figures of the session that just ended."""
    global _ended
    _ended = figures
