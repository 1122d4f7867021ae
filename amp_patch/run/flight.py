"""The forwards of an initialized model as work in flight (``base.inflight``):
two forward hooks per model enter and leave the session's ``InFlight``, so
``initialize`` and ``deinitialize`` wait for a forward in another thread, and
the outermost forward empties the weight-cast cache. Costs one lock round trip
per model forward, never anything per op.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch
from torch.compiler import is_compiling

from ..base.inflight import InFlight
from ..patching import jit
from ..precision import copies

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ..patching.cast import CastCache
    from .session import Session


class _Forwards:
    """What the two forward hooks of one session share: per thread, whether each
    forward in flight was counted; and the session's weight-cast cache, emptied
    when a forward starts outside another."""

    def __init__(self, flight: InFlight, cache: Optional["CastCache"] = None):
        self.flight = flight
        self.cache = cache
        self.counted = threading.local()


class ForwardStart:
    """Forward pre-hook of an initialized model: a forward starts."""

    def __init__(self, shared: _Forwards):
        self.shared = shared

    def __deepcopy__(self, memo: dict) -> "ForwardStart | ForwardEnd":
        return self  # shares the session's lock; the copy rule then drops the hook

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        # A forward that starts after the session ended counts nothing, and its
        # end hook (called even so when torch collected it before the removal)
        # must not leave: each thread keeps whether each of its forwards counted.
        if is_compiling():
            return  # a compiled forward is one graph: not tracked, and no graph break
        s = self.shared
        stack = getattr(s.counted, "stack", None)
        if stack is None:
            stack = s.counted.stack = []
        if s.cache is not None and not s.flight.inside("forward"):
            # The outermost forward starts: the half weight copies of an earlier
            # one may be stale, since a write through `.data` (an EMA swap,
            # pruning) bumps no version counter. As torch.autocast empties its
            # cache when its region (usually one forward) ends; patching/cast.py.
            s.cache.clear()
        stack.append(s.flight.enter("forward"))


class ForwardEnd:
    """Forward hook (always called, on errors too) of an initialized model: the forward ended."""

    def __init__(self, shared: _Forwards):
        self.shared = shared

    def __deepcopy__(self, memo: dict) -> "ForwardStart | ForwardEnd":
        return self  # shares the session's lock; the copy rule then drops the hook

    def __call__(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if is_compiling():
            return
        s = self.shared
        stack = getattr(s.counted, "stack", None)
        if stack and stack.pop():
            s.flight.leave()


#: the hooks ``watch`` adds: a copy of any model drops them (``precision.copies``)
HOOK_TYPES = (ForwardStart, ForwardEnd)
copies.drop_on_copy(*HOOK_TYPES)


class _Unwatch:
    """Undo callback: the forward hooks (and the copy rule, if ``watch`` set it) off a model."""

    def __init__(self, model: torch.nn.Module, handles: List["RemovableHandle"], copyable: bool):
        self.model, self.handles, self.copyable = model, handles, copyable

    def __call__(self) -> None:
        for h in self.handles:
            h.remove()
        if self.copyable:
            copies.remove(self.model)


def watch(amp: "Session", models: Sequence[torch.nn.Module]) -> None:
    """Track the forwards of ``models`` as work in flight of ``amp``'s session.

    A deep copy or pickle of a watched model leaves the hooks behind (they hold
    the session's lock, and a copy is not the session's): a converted model's
    copy rule drops them already, any other model gets one that only does that.
    So does ``torch.jit.script`` of such a model (``patching.jit.hide_hooks``).
    """
    shared = _Forwards(amp.flight, amp.cache)
    if models:
        jit.hide_hooks_from_script(amp.undo)
    for m in models:
        if isinstance(m, torch.jit.ScriptModule):
            continue  # takes no hooks; it runs in FP32 under O1 anyway (diagnostics says so)
        copyable = "__deepcopy__" not in m.__dict__
        handles: List["RemovableHandle"] = []
        amp.undo.push(_Unwatch(m, handles, copyable))
        if copyable:
            copies.install_hook_drop(m)
        handles.append(m.register_forward_pre_hook(ForwardStart(shared), prepend=True))
        handles.append(m.register_forward_hook(ForwardEnd(shared), always_call=True))
