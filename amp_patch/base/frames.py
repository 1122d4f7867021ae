"""Whose code a stack frame runs: the user's, amp_patch's, or a library's.

Decided from the frame's module (its globals), never from file paths, so
moving a module does not change the answer. A module of amp_patch declares
its frames' role with a module-level marker::

    __amp_patch_frame__ = "machinery"   # the op call itself: wrappers, casts, modes
    __amp_patch_frame__ = "user"        # runs as a user's code would (the demo's loop)

Any other module of the package is amp_patch acting on its own behalf
("internal": the loss scaler, model conversion).
"""
from __future__ import annotations

from types import FrameType
from typing import Optional

#: the module attribute that declares a role
MARKER = "__amp_patch_frame__"
MACHINERY = "machinery"
USER = "user"

PACKAGE = __name__.partition(".")[0]
_LIBRARIES = ("torch", "wrapt")


def module_name(frame: FrameType) -> str:
    return frame.f_globals.get("__name__") or ""


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_ours(frame: FrameType) -> bool:
    """A frame of any amp_patch module."""
    return _within(module_name(frame), PACKAGE)


def is_library(frame: FrameType) -> bool:
    """A frame of torch, wrapt or Python's frozen modules (the launcher's ``runpy``)."""
    name = module_name(frame)
    return any(_within(name, lib) for lib in _LIBRARIES) or frame.f_code.co_filename.startswith("<frozen")


def is_torch(frame: FrameType) -> bool:
    return _within(module_name(frame), "torch")


def role(frame: FrameType) -> Optional[str]:
    """The frame's module's declared role (``MACHINERY``, ``USER``), or None."""
    return frame.f_globals.get(MARKER) if is_ours(frame) else None


def is_machinery(frame: FrameType) -> bool:
    return role(frame) == MACHINERY


def is_internal(frame: Optional[FrameType]) -> bool:
    """amp_patch itself made the call (not its op machinery's caller, not the demo's loop)."""
    return frame is not None and is_ours(frame) and role(frame) != USER


def first_outside_ours(frame: Optional[FrameType]) -> tuple:
    """``(frame, levels)``: the first frame from ``frame`` outward that is not
    amp_patch's, torch's, wrapt's or frozen, and how many frames out it is."""
    levels = 0
    while frame is not None and (is_ours(frame) or is_library(frame)):
        frame = frame.f_back
        levels += 1
    return frame, levels
