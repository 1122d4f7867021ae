"""Model conversion for O2/O3/O5 (half-precision model, FP32 batchnorm)."""
from __future__ import annotations

from .errors import ConfigError


def validate(models, optimizers, props, options) -> None:
    """Check models/optimizers/options for the model side before anything changes."""
    if props.cast_model_type is not None and props.cast_model_type != __import__("torch").float32:
        raise ConfigError(f"opt_level={props.opt_level!r} is not available yet")


def attach(amp, models, optimizers) -> None:
    """Convert ``models`` and attach master weights to ``optimizers``."""
