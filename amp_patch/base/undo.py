"""The process's one undo stack.

Everything amp_patch changes outside its own objects (an attribute of torch,
a model's dtype, an optimizer's methods, the ``apex`` alias, a global hook) is
pushed here as the callable that undoes it, in the same step as the change,
tagged with its **owner**: the session that made it, or the launch that
started the process's AMP. An owner undoes only its own entries, newest first
(``Owned.pop_to``), so the launcher ending its hooks never pops a session's
patches, and a session ending leaves the launcher's alias in place.

``Owned`` is an owner's view of the stack: what a session and a launch hold
and push through.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Callable, Iterator, List

Undo = Callable[[], None]


@dataclasses.dataclass
class Entry:
    """One change: who made it, the callable that undoes it, and what kind of change it is."""

    owner: object
    undo: Undo
    kind: str
    seq: int


class UndoStack:
    """Every change in the process, oldest first, each with its owner."""

    def __init__(self) -> None:
        self._entries: List[Entry] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()

    def push(self, owner: object, undo: Undo, kind: str = "change") -> None:
        """Record a change ``owner`` just made, as the callable that undoes it."""
        with self._lock:
            self._entries.append(Entry(owner, undo, kind, next(self._seq)))

    def mark(self) -> int:
        """A point in time: ``pop_to(owner, mark)`` undoes ``owner``'s changes made after it."""
        return next(self._seq)  # every entry pushed later has a larger seq

    def entries(self, owner: object) -> List[Entry]:
        """``owner``'s entries, oldest first."""
        with self._lock:
            return [e for e in self._entries if e.owner is owner]

    def pop_to(self, owner: object, mark: int, kind: str = "") -> None:
        """Undo ``owner``'s changes made since ``mark`` (only those of ``kind``
        when given), newest first.

        Goes on past a failing undo (a partial undo is the worst outcome) and
        raises the first error at the end.
        """
        errors = []
        while True:
            with self._lock:
                mine = [i for i, e in enumerate(self._entries)
                        if e.owner is owner and e.seq >= mark and (not kind or e.kind == kind)]
                if not mine:
                    break
                entry = self._entries.pop(mine[-1])
            try:
                entry.undo()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


#: the process's undo stack
STACK = UndoStack()


class Owned:
    """One owner's view of ``STACK``: push, mark and pop its own changes only."""

    def __init__(self, owner: object, stack: UndoStack = STACK):
        self.owner, self.stack = owner, stack

    def push(self, undo: Undo, kind: str = "change") -> None:
        """Record a change just made, as the callable that undoes it."""
        self.stack.push(self.owner, undo, kind)

    def mark(self) -> int:
        """Where the stack stands now, for ``pop_to``."""
        return self.stack.mark()

    def pop_to(self, mark: int, kind: str = "") -> None:
        """Undo this owner's changes since ``mark`` (of ``kind`` only, when given), newest first."""
        self.stack.pop_to(self.owner, mark, kind)

    def count(self, kind: str) -> int:
        """How many of this owner's entries are of ``kind``."""
        return sum(e.kind == kind for e in self.stack.entries(self.owner))

    def __len__(self) -> int:
        return len(self.stack.entries(self.owner))

    def __iter__(self) -> Iterator[Undo]:
        return iter([e.undo for e in self.stack.entries(self.owner)])
