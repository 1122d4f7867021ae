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
from typing import Dict, List, Optional

from .errors import StateError

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
