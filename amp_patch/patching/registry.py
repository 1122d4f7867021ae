"""The patch registry: put wrappers on attributes and take them off exactly.

This module owns every attribute amp_patch changes on torch. A patch records
the owner, the name, and whether the value was the owner's *own* attribute
(``vars(owner)``) or inherited. Undo replays the records in reverse order and
uses ``delattr`` for inherited ones, so ``vars(torch.Tensor)`` is left exactly
as it was (most Tensor methods live on ``torch._C.TensorBase``).

Our registry, not wrapt, is the one source of truth for what is patched;
the process's undo stack (``base.undo``) holds how to take it off.

While an attribute is patched, its wrapper stands for the original in
TorchScript's table of builtins (``builtin_table``), so that code scripted
meanwhile compiles to the original op and runs uncast; the entry goes with the
patch (see ``patching.jit``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..base.undo import Owned

_NOTSET = object()


def builtin_table() -> Optional[Dict[int, str]]:
    """TorchScript's table of builtins, ``{id(function): "aten::name"}``, built
    now if it is not yet (while torch is unpatched, so that it never records a
    wrapper itself), or None where torch has no TorchScript."""
    try:
        from torch.jit import _builtins

        return _builtins._get_builtin_table()
    except Exception:  # pragma: no cover - a torch without TorchScript
        return None


#: ``(owner, name, make_wrapper)``: patch ``owner.name`` with ``make_wrapper(original)``
PatchItem = Tuple[object, str, Callable[[Any], Any]]


class PatchRecord:
    """One changed attribute: enough to put it back exactly."""

    __slots__ = ("owner", "name", "own", "old", "new", "builtin", "shadowed")

    def __init__(self, owner: object, name: str, own: object, old: object, new: object):
        self.owner = owner
        self.name = name
        self.own = own  # the owner's own value before patching, or _NOTSET
        self.old = old  # the value seen through getattr before patching
        self.new = new
        #: the TorchScript builtin ``new`` is entered as ("aten::conv2d"), or None
        self.builtin: Optional[str] = None
        #: what the builtin table held under id(new) before, or _NOTSET
        self.shadowed: object = _NOTSET


class Patcher:
    """The attributes one owner patched, in the order it patched them.

    Every batch ``apply`` patches is pushed onto the owner's view of the
    process's undo stack (``base.undo.Owned``) as one entry of kind
    ``"patch"``, so the registry keeps no undo stack of its own: the owner's
    ``pop_to`` takes patches off, and ``apply`` is all or nothing (if one
    ``setattr`` fails, the ones already done are put back before the error
    propagates).
    """

    KIND = "patch"

    def __init__(self, undo: Owned) -> None:
        self._undo = undo
        self._index: Dict[Tuple[int, str], PatchRecord] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._index)

    def is_patched(self, owner: object, name: str) -> bool:
        return (id(owner), name) in self._index

    def originals(self) -> List[Tuple[object, str, object]]:
        """``(owner, name, original)`` of every patched attribute, oldest first."""
        return [(r.owner, r.name, r.old) for r in self._index.values()]

    def get_original(self, owner: object, name: str) -> object:
        """The value ``owner.name`` had before we first patched it."""
        rec = self._index.get((id(owner), name))
        return getattr(owner, name) if rec is None else rec.old

    def apply(self, items: Sequence[PatchItem]) -> int:
        """Patch each ``(owner, name, make_wrapper)``; ``make_wrapper(original)``.

        A name already patched is skipped: we never wrap our own wrapper.
        Returns how many were patched.
        """
        done: List[PatchRecord] = []
        builtins = builtin_table()
        try:
            for owner, name, make in items:
                if (id(owner), name) in self._index:
                    continue
                own = vars(owner).get(name, _NOTSET) if hasattr(owner, "__dict__") else _NOTSET
                old = getattr(owner, name)
                new = make(old)
                setattr(owner, name, new)
                rec = PatchRecord(owner, name, own, old, new)
                done.append(rec)
                self._index[(id(owner), name)] = rec
                builtin = builtins.get(id(old)) if builtins is not None else None
                if builtin is not None and new is not old:
                    # scripted code sees the original op (patching.jit)
                    rec.builtin, rec.shadowed = builtin, builtins.get(id(new), _NOTSET)
                    builtins[id(new)] = builtin
        except BaseException:
            self._restore(done)
            raise
        if done:
            self._undo.push(_Unpatch(self, done), self.KIND)
        return len(done)

    def unpatch_all(self) -> None:
        """Take every patch of this registry off, newest first."""
        self._undo.pop_to(0, self.KIND)

    def _restore(self, records: List[PatchRecord]) -> None:
        builtins = builtin_table()
        for rec in reversed(records):
            self._index.pop((id(rec.owner), rec.name), None)
            if rec.builtin is not None and builtins is not None and builtins.get(id(rec.new)) == rec.builtin:
                # out of TorchScript's table before the wrapper can die and its id be reused
                if rec.shadowed is _NOTSET:
                    del builtins[id(rec.new)]
                else:
                    builtins[id(rec.new)] = rec.shadowed
                rec.builtin = None
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


class _Unpatch:
    """Undo of one ``Patcher.apply`` batch."""

    def __init__(self, patcher: Patcher, records: List[PatchRecord]):
        self.patcher, self.records = patcher, records

    def __call__(self) -> None:
        self.patcher._restore(self.records)
