"""amp_patch: automatic mixed precision for existing PyTorch code, in one line.

    model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1")

See the README for the opt levels and the apex.amp drop-in, and docs/guide.md for the op lists.
"""

__version__ = "0.1.0"  # setup.cfg's version; first, so every module may import it

from .base.errors import (
    AmpError,
    BannedOpError,
    CastError,
    ConfigError,
    ListError,
    OverflowLoopError,
    StateError,
)
from .frontends.alias import install_apex_alias
from .frontend import (
    adopt_optimizer,
    deinitialize,
    disable_casts,
    float_function,
    half_function,
    initialize,
    is_initialized,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from .diagnostics import AmpWarning, find_overflow
from .scaling import (
    counters,
    load_state_dict,
    master_params,
    scale_loss,
    state_dict,
    unscale_,
)
from .diagnostics.report import plot, report, reset_stats

__all__ = [
    "AmpError",
    "AmpWarning",
    "BannedOpError",
    "CastError",
    "ConfigError",
    "ListError",
    "OverflowLoopError",
    "StateError",
    "adopt_optimizer",
    "counters",
    "deinitialize",
    "disable_casts",
    "find_overflow",
    "float_function",
    "half_function",
    "initialize",
    "install_apex_alias",
    "is_initialized",
    "load_state_dict",
    "master_params",
    "plot",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "report",
    "reset_stats",
    "scale_loss",
    "state_dict",
    "unscale_",
]
