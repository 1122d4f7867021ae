"""Which session runs now, and the figures of the last one to end.

A slot, not the session itself: the session (``amp_patch.run.session``) is
built from the subpackages, which ask this slot for it, so it lives at the
bottom and names the session's type for readers only.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from ..diagnostics.report import Report
    from ..run.session import Session


@dataclasses.dataclass(frozen=True)
class Ended:
    """The figures of the last session to end, taken as it ended: what
    ``counters()`` and ``report()`` give after ``deinitialize``."""

    counters: Dict[str, object]
    report: "Report"
    #: how many torch functions its op lists patched, per policy (empty at O0/O2/O3/O5)
    patched: Dict[str, int] = dataclasses.field(default_factory=dict)


_session: Optional["Session"] = None
_ended: Optional[Ended] = None


def session() -> Optional["Session"]:
    """The running session, or None."""
    return _session


def set_session(s: Optional["Session"]) -> None:
    """Make ``s`` the running session (None: no session runs)."""
    global _session
    _session = s


def last_ended() -> Optional[Ended]:
    """The last ended session's figures, or None before any session ended."""
    return _ended


def set_ended(figures: Ended) -> None:
    """Keep the figures of the session that just ended."""
    global _ended
    _ended = figures
