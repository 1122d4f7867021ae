"""What a mechanism sees of the session it belongs to (``SessionView``).

Each mechanism's state object (``precision.Conversions``,
``diagnostics.Diagnostics``) is handed its session's undo view and two
callables, never the session: the settings as they are now (a later
``initialize`` may replace them, and only ``run/`` writes them) and the models
the session holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

if TYPE_CHECKING:
    from .undo import Owned


class SessionView:
    """A mechanism's narrow view of its session.

    Args:
        undo: the session's entries on the undo stack; every change is pushed there.
        config: the session's settings now, its ``config.AmpConfig`` (a callable:
            a later ``initialize`` may replace them; not imported here, a floor above).
        models: the models the session holds (a callable: later calls add some).
    """

    def __init__(self, undo: "Owned", config: Callable[[], Any],
                 models: Callable[[], Sequence[torch.nn.Module]]):
        self.undo = undo
        self._config = config
        self._models = models

    @property
    def config(self) -> Any:
        """The session's settings as they are now (``config.AmpConfig``)."""
        return self._config()

    @property
    def models(self) -> Sequence[torch.nn.Module]:
        """The models the session holds."""
        return self._models()
