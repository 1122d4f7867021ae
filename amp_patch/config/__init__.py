"""What a run is asked to do, checked before anything changes: the opt-level
presets as data (``presets``) and the one frozen ``AmpConfig`` every entry
point builds through ``parse`` (``config``)."""
from __future__ import annotations

from .config import (
    CAST_POLICIES,
    ENV_HALF_DTYPE,
    EXTRA_OPTIONS,
    OPTIONS,
    OVERRIDES,
    PER_CALL,
    SCALER_FIELDS,
    SESSION_WIDE,
    AmpConfig,
    ScalerConfig,
    default_half_dtype,
    parse,
    parse_bool,
    parse_dtype,
    parse_level,
    parse_loss_scale,
)
from .presets import FUNCTION_LEVELS, MODEL_LEVELS, OPT_LEVELS, PRESETS, Preset

__all__ = [
    "AmpConfig", "CAST_POLICIES", "ENV_HALF_DTYPE", "EXTRA_OPTIONS", "FUNCTION_LEVELS", "MODEL_LEVELS", "OPTIONS",
    "OPT_LEVELS", "OVERRIDES", "PER_CALL", "PRESETS", "Preset", "SCALER_FIELDS", "SESSION_WIDE", "ScalerConfig",
    "default_half_dtype", "parse", "parse_bool", "parse_dtype", "parse_level", "parse_loss_scale",
]
