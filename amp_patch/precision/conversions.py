"""The state ``precision/`` keeps for one session: ``Conversions``.

What conversion changed in each model, the FP8 layers that stand in for its
``nn.Linear`` layers, and the look-ups the checkpoint and forward hooks make
at call time (a parameter's FP32 master, the dtypes from before the cast).

The session (``run.session``) builds one and hands it, of the rest of
itself, only its undo view and a few callables; the functions of
``precision/`` take this object, never the session.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from ..base import running
from ..base.view import SessionView

if TYPE_CHECKING:
    from ..base.undo import Owned
    from ..config import AmpConfig
    from .fp8 import Fp8Model
    from .master import MasterWeights
    from .model import Conversion

Tensor = torch.Tensor


class _Forget:
    """Undo of ``Conversions.add_fp8``: the FP8 records back to their old length."""

    def __init__(self, items: List["Fp8Model"], n: int):
        self.items, self.n = items, n

    def __call__(self) -> None:
        del self.items[self.n:]


class Conversions(SessionView):
    """The model conversions and FP8 layers of one session, and their look-ups.

    Args:
        undo: the session's entries on the undo stack; every change is pushed there.
        config: the session's settings now (a callable: a later ``initialize``
            may replace them).
        models: the models the session holds.
        masters: the FP32 masters loss scaling holds, one per optimizer with masters.
        known: whether loss scaling keeps a handle for an optimizer (attached,
            or being attached).
        attached: whether an optimizer is attached to the session.
        live: whether the session is still the running one.
    """

    def __init__(self, undo: "Owned", config: Callable[[], "AmpConfig"], *,
                 models: Callable[[], Sequence[torch.nn.Module]],
                 masters: Callable[[], Iterable["MasterWeights"]],
                 known: Callable[[torch.optim.Optimizer], bool],
                 attached: Callable[[torch.optim.Optimizer], bool],
                 live: Callable[[], bool]):
        super().__init__(undo, config, models)
        self._masters = masters
        self.known = known
        self.attached = attached
        self.live = live
        #: one conversion record per converted or hooked model (``model.attach``, ``model.cast_outputs``)
        self.records: List["Conversion"] = []
        #: O6/O7: one record per model of its FP8 layers (``fp8.attach``)
        self.fp8: List["Fp8Model"] = []

    def masters(self) -> Iterable["MasterWeights"]:
        """The FP32 masters of every optimizer that has them."""
        return self._masters()

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        """The FP32 master of a model parameter, or None."""
        for mw in self._masters():
            m = mw.master_of(param)
            if m is not None:
                return m
        return None

    def masters_holding(self, m: Tensor) -> "MasterWeights":
        """The ``MasterWeights`` that ``m`` is a master of; LookupError if none."""
        for mw in self._masters():
            if mw.is_master(m):
                return mw
        raise LookupError("master without its MasterWeights")

    def dtypes_before(self) -> Dict[int, torch.dtype]:
        """Each converted parameter's dtype from before ``initialize``, by id: the
        dtype ``deinitialize`` gives it back in."""
        return {id(q): d for rec in self.records for q, d in rec.params}

    def add_fp8(self, rec: "Fp8Model") -> None:
        """Keep one model's FP8 record, and push the undo that forgets it."""
        self.undo.push(_Forget(self.fp8, len(self.fp8)))
        self.fp8.append(rec)


def current() -> Optional[Conversions]:
    """The running session's ``Conversions``, or None. Hooks look it up at call
    time rather than keep one: a deep copy of a converted model then finds no
    masters of its own, and a hook left after the session sees none."""
    amp = running.session()
    return None if amp is None else amp.precision
