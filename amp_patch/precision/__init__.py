"""Half-precision models: O2/O3/O5 conversion, FP32 master weights, copies of a
converted model, and what amp_patch refuses to convert.

One ``Conversions`` per session (``conversions``) holds what precision changed
and is all its functions are given of the session."""
from __future__ import annotations

from .conversions import Conversions

__all__ = ["Conversions"]
