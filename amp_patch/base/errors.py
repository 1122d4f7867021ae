"""Exceptions amp_patch raises. Each message names the input and the fix."""
from __future__ import annotations


class AmpError(Exception):
    """Base class of every amp_patch error."""


class ListError(AmpError, ValueError):
    """An op list (default or user override) is invalid.

    Raised before anything is patched, so torch is left untouched.
    """


class ConfigError(AmpError, ValueError):
    """``initialize`` got an invalid opt level, option or combination."""


class KeywordError(AmpError, TypeError):
    """A call named a keyword argument the function does not take (a misspelled
    ``opt_levl=``); the message names the nearest valid one.

    A ``TypeError``, as Python's own for an unexpected keyword, so code that
    catches that keeps working.
    """


class BannedOpError(AmpError, NotImplementedError):
    """An op that is unsafe in FP16 was called while FP16 casting is on.

    It is a ``NotImplementedError`` as in apex.amp, so existing handlers
    keep working.
    """


class CastError(AmpError, NotImplementedError):
    """A call cannot run in the precision its policy asks for (e.g. an
    in-place FP32 op on an FP16 tensor).

    A ``NotImplementedError`` (and so a ``RuntimeError``), as apex.amp's
    refusal was, so scripts that catch either keep working.
    """


class StateError(AmpError, RuntimeError):
    """An amp_patch function was called in the wrong order (e.g. ``scale_loss``
    before ``initialize``)."""


class OverflowLoopError(AmpError, FloatingPointError):
    """The loss scale is at its minimum and steps keep overflowing."""
