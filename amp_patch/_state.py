"""The running AMP state: one object while initialized, ``None`` otherwise.

Everything ``initialize`` did is recorded here so ``deinitialize`` can undo it:
the function patches (a ``Patcher``), the model conversions, the optimizer
attachments, and the loss scalers.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ._cast import CastCache
from ._patch import Patcher
from .inflight import InFlight
from .options import Options
from .properties import Properties
from .wrappers import Live


class AmpState:
    """What one ``initialize`` (and any compatible later ones) set up."""

    def __init__(self, props: Properties, table: Optional[dict], device_type: str):
        self.props = props
        self.table = table  # {(namespace, name): Entry} in force, or None at O0/O2/O3/O5
        self.device_type = device_type
        self.patcher = Patcher()
        self.cache = CastCache()
        self.live = Live()  # turned off at deinitialize: stray wrappers then call straight through
        self.models: List[Any] = []
        self.optimizers: List[Any] = []
        self.model_handles: List[Any] = []  # undo handles from model conversion
        self.optimizer_handles: Dict[int, Any] = {}  # id(optimizer) -> attachment
        self.scalers: List[Any] = []  # one LossScaler per loss id
        self.ledger: Any = None  # op ledger when collect_stats=True
        self.options = Options()  # amp_patch's own keywords, set by the first initialize
        self.undo_callbacks: List[Callable[[], None]] = []  # run in reverse at deinitialize
        self.flight = InFlight()  # forwards, backwards and steps in flight, per thread


_current: Optional[AmpState] = None


def current() -> Optional[AmpState]:
    return _current


def set_current(state: Optional[AmpState]) -> None:
    global _current
    _current = state
