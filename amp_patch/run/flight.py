"""Work in flight: which threads are inside a forward, backward or step that
amp_patch is running, so ``initialize`` and ``deinitialize`` never pull the
ground from under them.

What is allowed across threads:

- Training, inference and ``disable_casts`` in any number of threads.
- ``initialize`` / ``deinitialize`` from any thread. While a session runs they
  first wait until no other thread is inside a forward of an initialized model,
  a patched ``backward``, a patched ``optimizer.step()`` or a ``scale_loss``
  block, and keep new ones from starting until they are done. A wait longer
  than ``WAIT_SECONDS`` raises ``StateError`` naming the busy threads, with
  nothing changed.
- From inside such work in the same thread (a backward hook, a forward that
  calls ``deinitialize``) they are refused with ``StateError``: waiting there
  would wait forever, and going on would leave the backward's gradients scaled.

Tracking costs one lock round trip per model forward, backward and step,
never anything per op.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import torch
from torch.compiler import is_compiling

from ..base.errors import StateError
from ..patching import jit
from ..precision import copies

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ..patching.cast import CastCache
    from .session import Session

#: how long initialize/deinitialize wait for other threads' work in flight
WAIT_SECONDS = 60.0

_WHAT = {
    "forward": "a forward of a model given to initialize",
    "backward": "a loss.backward() amp_patch scales",
    "step": "an optimizer.step() amp_patch runs",
    "scale_loss": "a `with amp_patch.scale_loss(...)` block",
}


class InFlight:
    """Per-thread stacks of the work in flight in one session."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._work: Dict[int, List[str]] = {}  # thread ident -> kinds entered, innermost last
        self._names: Dict[int, str] = {}
        self._closer: Optional[int] = None  # the thread changing the session, if any
        self.ended = False  # the session is over: entering counts nothing

    def enter(self, kind: str) -> bool:
        """Record ``kind`` as started in this thread; False when the session is over.

        Waits while another thread is changing the session, so the work starts
        either wholly before or wholly after the change.
        """
        me = threading.get_ident()
        with self._cv:
            while self._closer is not None and self._closer != me:
                self._cv.wait()
            if self.ended:
                return False
            stack = self._work.get(me)
            if stack is None:
                stack = self._work[me] = []
                self._names[me] = threading.current_thread().name
            stack.append(kind)
            return True

    def leave(self) -> None:
        me = threading.get_ident()
        with self._cv:
            stack = self._work.get(me)
            if not stack:
                return
            stack.pop()
            if not stack:
                del self._work[me]
                del self._names[me]
                self._cv.notify_all()

    def inside(self, kind: str) -> bool:
        """Whether this thread is inside ``kind`` work (no lock: only this thread writes its stack)."""
        stack = self._work.get(threading.get_ident())
        return bool(stack) and kind in stack

    def hold(self, what: str, timeout: Optional[float] = None) -> "_Hold":
        """A context in which this thread alone may change the session.

        Refuses when this thread has work in flight; waits for other threads'
        work to end (up to ``timeout``, default ``WAIT_SECONDS``), then keeps
        new work waiting until the context exits.
        """
        return _Hold(self, what, WAIT_SECONDS if timeout is None else timeout)


class _Hold:
    def __init__(self, flight: InFlight, what: str, timeout: float):
        self.flight, self.what, self.timeout = flight, what, timeout

    def __enter__(self) -> None:
        f, me = self.flight, threading.get_ident()
        with f._cv:
            mine = f._work.get(me)
            if mine:
                raise StateError(
                    f"{self.what} was called from inside {_WHAT[mine[-1]]} in the same thread (a hook?). "
                    f"It would leave that work's gradients scaled or its tensors in two precisions; call it "
                    f"after the step, outside forward and backward."
                )
            f._closer = me
            if not f._cv.wait_for(lambda: not f._work, self.timeout):
                busy = ", ".join(f"thread {f._names[t]!r} in {_WHAT[s[-1]]}" for t, s in f._work.items())
                f._closer = None
                f._cv.notify_all()
                raise StateError(
                    f"{self.what} waited {self.timeout:g} s for other threads' work to finish ({busy}); "
                    f"nothing was changed. Call it between steps, or stop the other threads' training first."
                )

    def __exit__(self, *exc: object) -> None:
        f = self.flight
        with f._cv:
            f._closer = None
            f._cv.notify_all()


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


def _no_value(*args: object) -> None:
    return None


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
            copies.install(m, copies.Plan(_no_value, {}, HOOK_TYPES, _no_value))
        handles.append(m.register_forward_pre_hook(ForwardStart(shared), prepend=True))
        handles.append(m.register_forward_hook(ForwardEnd(shared), always_call=True))
