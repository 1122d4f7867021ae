"""The amp_patch options of one ``initialize`` call: typed, checked once.

``Properties`` (``properties.py``) holds what an opt level means, Apex's
settings; ``Options`` holds amp_patch's own keywords. Both are frozen and
built before anything changes, so a bad value raises ``ConfigError`` with
torch untouched.

Two kinds of option:

- **Session-wide** (``SESSION_WIDE``): the loss scalers, the skip limit,
  statistics, overflow provenance, verbosity. The first ``initialize`` sets
  them; a later call that names a different value is refused with the
  difference (leaving one out keeps the running value).
- **Per call** (``keep_fp32``, ``save_dtype``, ``fused_update``,
  ``allow_half_params``): they apply to
  the models and optimizers of the call that gives them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Union

import torch

from .errors import ConfigError
from .properties import parse_dtype

#: the default of ``max_consecutive_skips``: that many skipped steps in a row at
#: the minimum loss scale raise ``OverflowLoopError``
MAX_CONSECUTIVE_SKIPS = 20

SCALER = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
          "min_loss_scale", "max_loss_scale")
SESSION_WIDE = ("num_losses",) + SCALER + ("max_consecutive_skips", "collect_stats", "find_overflow", "verbosity",
                                           "cast_policy")
#: ``cast_policy``: "parity" casts as torch.autocast does; "auto" keeps half-list
#: matmuls too small for the half kernel to win in FP32 (``patching.costs``)
CAST_POLICIES = ("parity", "auto")
PER_CALL = ("keep_fp32", "save_dtype", "fused_update", "enabled", "allow_half_params")

KeepFP32 = Union[None, Tuple[str, ...], Callable[[torch.nn.Module, str], bool]]


@dataclasses.dataclass(frozen=True)
class Options:
    """amp_patch's keywords to ``initialize`` (see its docstring for each)."""

    num_losses: int = 1
    # the loss scaler checks its own settings (``scaling.validate_options``); None: its default
    init_scale: Optional[float] = None
    growth_factor: Optional[float] = None
    backoff_factor: Optional[float] = None
    growth_interval: Optional[int] = None
    hysteresis: Optional[int] = None
    min_loss_scale: Optional[float] = None
    max_loss_scale: Optional[float] = None
    max_consecutive_skips: Optional[int] = MAX_CONSECUTIVE_SKIPS
    collect_stats: bool = False
    find_overflow: bool = False
    verbosity: int = 1
    keep_fp32: KeepFP32 = None
    save_dtype: torch.dtype = torch.float32
    fused_update: bool = False
    enabled: bool = True
    #: O1/O4: accept FP16/BF16 parameters in the optimizer and step them as they
    #: are (Apex's ``_amp_state.allow_incoming_model_not_fp32``)
    allow_half_params: bool = False
    cast_policy: str = "parity"
    #: the names the caller passed, so a later call compares only those
    given: FrozenSet[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("collect_stats", "find_overflow", "fused_update", "enabled", "allow_half_params"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"initialize: {name}={getattr(self, name)!r} must be True or False")
        _count("num_losses", self.num_losses, "one loss scaler per loss")
        if self.max_consecutive_skips is not None:
            _count("max_consecutive_skips", self.max_consecutive_skips, "or None to never stop")
        v = self.verbosity
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"initialize: verbosity={v!r} must be an integer >= 0 (0 silences amp_patch's messages, 1 is the default)")
        object.__setattr__(self, "save_dtype", parse_dtype(self.save_dtype, "save_dtype", (torch.float16, torch.bfloat16, torch.float32)))
        object.__setattr__(self, "keep_fp32", _keep_fp32(self.keep_fp32))
        if self.cast_policy not in CAST_POLICIES:
            raise ConfigError(
                f"initialize: cast_policy={self.cast_policy!r} must be 'parity' (cast as torch.autocast does, the "
                f"default) or 'auto' (keep matmuls too small for the half dtype to win in float32)"
            )

    @classmethod
    def build(cls, **kwargs: Any) -> "Options":
        """``Options`` from ``initialize``'s keywords, remembering which were given."""
        # None is "not given" (the default), except for max_consecutive_skips,
        # where it means "never stop"
        given = {k: v for k, v in kwargs.items() if v is not None or k == "max_consecutive_skips"}
        return cls(**given, given=frozenset(given))

    def scaler_kwargs(self) -> Dict[str, Any]:
        """The ``LossScaler`` keywords this run sets (the rest keep the scaler's defaults)."""
        return {k: getattr(self, k) for k in SCALER if getattr(self, k) is not None}

    def differences(self, running: "Options") -> List[str]:
        """Session-wide options this call names with values the running session does not have."""
        return [
            f"{k}={getattr(self, k)!r} (running: {getattr(running, k)!r})"
            for k in SESSION_WIDE
            if k in self.given and getattr(self, k) != getattr(running, k)
        ]


def _count(name: str, value: Any, why: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"initialize: {name}={value!r} must be an integer >= 1 ({why})")


def _keep_fp32(value: Any) -> KeepFP32:
    """``keep_fp32`` as a tuple of module-name patterns, a callable, or None.

    Whether each pattern matches a module is checked against the models
    (``model.validate``), which this object does not see.
    """
    if value is None or callable(value):
        return value
    patterns = (value,) if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(
            f"keep_fp32={value!r} must be a callable (module, name) -> bool or a list of "
            f"module-name patterns such as ['classifier', '*.norm*']"
        )
    return tuple(patterns)
