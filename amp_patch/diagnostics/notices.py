"""``AmpWarning`` and how amp_patch warns: once per message, at the user's line."""
from __future__ import annotations

import sys
import warnings
from typing import Sequence

from ..base import frames

class AmpWarning(UserWarning):
    """A set-up amp_patch can run, but slower or otherwise than intended."""


_warned: set = set()


def stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first
    frame outside amp_patch, torch, wrapt and Python's frozen modules (the
    launcher's ``runpy``), so a warning raised from a patched call, an
    optimizer hook or the launcher names the script's own line."""
    return 1 + frames.first_outside_ours(sys._getframe(1))[1]


def warn_once(message: str) -> None:
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, AmpWarning, stacklevel=stacklevel())


def forget_warned(messages: Sequence[str]) -> None:
    """Let once-only warnings that were held back and dropped be given again."""
    _warned.difference_update(messages)


def warn_user(message: str, category: type = None) -> None:
    """Warn (``AmpWarning`` unless ``category`` says otherwise), pointing at the user's line."""
    warnings.warn(message, category or AmpWarning, stacklevel=stacklevel())
