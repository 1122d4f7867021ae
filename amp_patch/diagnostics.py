"""Warnings at initialize and overflow provenance."""
from __future__ import annotations


def warn_at_initialize(amp, models, optimizers) -> None:
    """Warn once about set-ups that run slower or wrongly."""


def arm_find_overflow(amp) -> None:
    """Arm overflow provenance for the next skipped step."""
