"""The patch registry: put wrappers on attributes and take them off exactly.

This module owns every attribute amp_patch changes on torch. A patch records
the owner, the name, and whether the value was the owner's *own* attribute
(``vars(owner)``) or inherited. Undo replays the records in reverse order and
uses ``delattr`` for inherited ones, so ``vars(torch.Tensor)`` is left exactly
as it was (most Tensor methods live on ``torch._C.TensorBase``).

Our registry, not wrapt, is the one source of truth for what is patched.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

_NOTSET = object()


class PatchRecord:
    """One changed attribute: enough to put it back exactly."""

    __slots__ = ("owner", "name", "own", "old", "new")

    def __init__(self, owner: Any, name: str, own: Any, old: Any, new: Any):
        self.owner = owner
        self.name = name
        self.own = own  # the owner's own value before patching, or _NOTSET
        self.old = old  # the value seen through getattr before patching
        self.new = new


class Patcher:
    """An undo stack of attribute patches.

    ``apply`` is all or nothing when given a batch: if one ``setattr`` fails,
    the ones already done are undone before the error propagates.
    """

    def __init__(self) -> None:
        self._records: List[PatchRecord] = []
        self._index: Dict[Tuple[int, str], PatchRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def is_patched(self, owner: Any, name: str) -> bool:
        return (id(owner), name) in self._index

    def originals(self) -> List[Tuple[Any, str, Any]]:
        """``(owner, name, original)`` of every patched attribute, oldest first."""
        return [(r.owner, r.name, r.old) for r in self._records]

    def get_original(self, owner: Any, name: str) -> Any:
        """The value ``owner.name`` had before we first patched it."""
        rec = self._index.get((id(owner), name))
        return getattr(owner, name) if rec is None else rec.old

    def apply(self, items: List[Tuple[Any, str, Callable[[Any], Any]]]) -> int:
        """Patch each ``(owner, name, make_wrapper)``; ``make_wrapper(original)``.

        A name we already patched is skipped: we never wrap our own wrapper.
        Returns how many were patched (``undo(n)`` takes them off again).
        """
        done = 0
        try:
            for owner, name, make in items:
                if (id(owner), name) in self._index:
                    continue
                own = vars(owner).get(name, _NOTSET) if hasattr(owner, "__dict__") else _NOTSET
                old = getattr(owner, name)
                new = make(old)
                setattr(owner, name, new)
                rec = PatchRecord(owner, name, own, old, new)
                self._records.append(rec)
                self._index[(id(owner), name)] = rec
                done += 1
        except BaseException:
            self.undo(done)
            raise
        return done

    def undo(self, count: int | None = None) -> None:
        """Undo the last ``count`` patches (all by default), newest first."""
        n = len(self._records) if count is None else count
        for _ in range(n):
            rec = self._records.pop()
            del self._index[(id(rec.owner), rec.name)]
            if rec.own is _NOTSET:
                try:
                    delattr(rec.owner, rec.name)
                except AttributeError:
                    pass
                # A module-like owner whose attribute came from __getattr__
                # (torch._VF) is fine after delattr; anything else that now
                # resolves to something other than the original gets it back.
                if getattr(rec.owner, rec.name, _NOTSET) is not rec.old:
                    setattr(rec.owner, rec.name, rec.old)
            else:
                setattr(rec.owner, rec.name, rec.own)
