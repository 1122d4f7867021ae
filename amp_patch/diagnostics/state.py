"""The state ``diagnostics/`` keeps for one session: ``Diagnostics``.

The op ledger (``collect_stats=True``), the loss log of ``plot()`` and
``report()``, and the overflow watch with the last provenance it found, and
what ``report()`` reads of the other mechanisms, each as a narrow view.

The session (``run.session``) builds one and hands it, of the rest of
itself, only its undo view, the patcher and op table, and a few callables;
the functions of ``diagnostics/`` take this object, never the session.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import torch

from ..base.view import SessionView
from .stats import Ledger

if TYPE_CHECKING:
    from ..base.undo import Owned
    from ..config import AmpConfig
    from ..oplists import Entry
    from ..patching.registry import Patcher
    from .losses import LossLog
    from .overflow import _OverflowWatch


class Diagnostics(SessionView):
    """The op ledger, the loss log and the overflow watch of one session, and
    the views ``report()`` reads.

    Args:
        undo: the session's entries on the undo stack; the watches push their undo there.
        config: the session's settings now (a callable: a later ``initialize``
            may replace them).
        device_type: the device the session runs on (``"cuda"``, ``"cpu"``).
        patcher: the session's registry of patched attributes (the originals
            behind the op names, and what is patched).
        table: ``{(namespace, name): Entry}`` of the op lists in force, or None.
        models: the models the session holds.
        scalers: the session's loss scalers, in ``loss_id`` order.
        fp8: the rows of the FP8 layers of the models (``precision.fp8``), for the report.
        collect_stats: keep an op ledger.
    """

    def __init__(self, undo: "Owned", config: Callable[[], "AmpConfig"], device_type: str, *,
                 patcher: "Patcher", table: Optional[Dict[tuple, "Entry"]],
                 models: Callable[[], Sequence[torch.nn.Module]],
                 scalers: Callable[[], Sequence[Any]],
                 fp8: Callable[[], List[Dict[str, Any]]],
                 collect_stats: bool = False):
        super().__init__(undo, config, models)
        self.device_type = device_type
        self.patcher = patcher
        self.table = table
        self._scalers = scalers
        self._fp8 = fp8
        #: the op ledger when ``collect_stats=True``, else None; the casting wrappers
        #: record into this same object (``patching.spec.Casting.ledger``)
        self.ledger: Optional[Ledger] = Ledger() if collect_stats else None
        #: the true loss of every backward (``losses.log_of`` makes it on the first one)
        self.losses: Optional["LossLog"] = None
        #: overflow provenance while armed (``overflow.arm_find_overflow``), else None
        self.watch: Optional["_OverflowWatch"] = None

    def scalers(self) -> Sequence[Any]:
        """The session's loss scalers (``scaling.scaler.LossScaler``, a floor above)."""
        return self._scalers()

    def fp8_rows(self) -> List[Dict[str, Any]]:
        """One dict per ``nn.Linear`` of the models at O6/O7 (``Report.fp8``); empty otherwise."""
        return self._fp8()
