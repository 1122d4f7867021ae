"""What amp_patch tells the user: warnings at ``initialize`` (``setup_checks``),
where an overflow came from (``overflow``), which ops ran in which precision
(``stats``, ``report``), the true loss of each backward for ``plot()``
(``losses``), and how it warns (``notices``). ``Diagnostics`` (``state``) holds
one session's share of it; the functions here take that object, never the session."""
from __future__ import annotations

from .losses import record_loss
from .notices import AmpWarning, forget_warned, warn_user
from .overflow import arm_find_overflow, find_overflow, last_overflow, on_skipped_step
from .setup_checks import warn_at_initialize
from .state import Diagnostics

__all__ = ["AmpWarning", "Diagnostics", "arm_find_overflow", "find_overflow", "forget_warned", "last_overflow",
           "on_skipped_step", "record_loss", "warn_at_initialize", "warn_user"]
