"""The watching mode behind the diagnostics, and the names of torch's functions.

The op ledger's "unlisted ops" and overflow provenance must see every torch
call, patched or not. They do it with one ``TorchFunctionMode`` per thread
that calls each function and then hands ``(func, args, kwargs, out)`` to the
observers registered here. The mode exists only while an observer does, so a
run without ``collect_stats`` or ``find_overflow`` never meets it.

Torch keeps its mode stack per thread: the mode is pushed on the thread that
registers an observer (or calls ``ensure_here``) and taken off on the thread
that removes the last one. On any other thread it is left in place but, with
no observer, only calls straight through.

``caller`` finds the frame that made a torch call, past torch and the op
machinery, so a call can be charged to the user's line or recognised as
amp_patch's own (the loss scaler's arithmetic); ``caller_and_utility`` also
names the torch utility (``clip_grad_norm_``) the call came from inside of. ``OpNames`` maps a function
object torch hands to a mode back to the public names under which amp_patch
could patch it (``torch.nn.functional.linear``).
"""
from __future__ import annotations

__amp_patch_frame__ = "machinery"  # frames.py: the op call itself, never its caller

import functools
import sys
import threading
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch
import wrapt
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode

from ..base import frames

from ..patching import wrappers
from ..oplists import NAMESPACES, OPERATOR_FORMS

if TYPE_CHECKING:
    from types import FrameType

    from ..oplists import Entry
    from ..patching.registry import Patcher

Observer = Callable[[object, tuple, dict, object], None]

# Replaced as a whole, never mutated, so every thread's mode can read it
# without a lock.
_observers: Tuple[Observer, ...] = ()
_lock = threading.Lock()
_local = threading.local()


_WRAPT_TYPES = (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)
_PREFIX = frames.PACKAGE + "."  # any amp_patch module: the backward and clip patches too


def _ours(func: object) -> bool:
    """True for a wrapt wrapper amp_patch put on a torch function."""
    if not isinstance(func, _WRAPT_TYPES):
        return False
    module = getattr(getattr(func, "_self_wrapper", None), "__module__", None)
    return isinstance(module, str) and module.startswith(_PREFIX)


class _Watch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if _ours(func):
            # A Python-level torch function (F.mse_loss, Tensor.backward)
            # that our patch already called re-dispatches, while a mode is
            # on, through its patched name; run the original, as it runs
            # with no mode, or the op would be cast, counted (or a loss
            # scaled) twice.
            func = func.__wrapped__
        out = func(*args, **kwargs)
        observers = _observers
        if observers:
            # Observers inspect tensors (dtype, min/max); that must neither
            # recurse into this mode nor reach a user's mode.
            with torch._C.DisableTorchFunction():
                for observe in observers:
                    observe(func, args, kwargs, out)
        return out


def ensure_here() -> None:
    """Make sure the watching mode is on this thread's mode stack."""
    if getattr(_local, "mode", None) is None:
        mode = _Watch()
        _push_mode(mode)
        _local.mode = mode


def add(observer: Observer) -> None:
    """Start calling ``observer`` for every torch call (this thread and any
    thread that calls ``ensure_here``)."""
    global _observers
    with _lock:
        if observer not in _observers:
            _observers = _observers + (observer,)
        wrappers.need_python("watch")
    ensure_here()


def remove(observer: Observer) -> None:
    """Stop calling ``observer``; the last removal takes the mode off this thread."""
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o != observer)
        last = not _observers
        if last:
            wrappers.need_python("watch", on=False)
    mode = getattr(_local, "mode", None)
    if last and mode is not None:
        _local.mode = None
        _take_off(mode)


def _take_off(mode: TorchFunctionMode) -> None:
    # A user's mode may have been entered after ours: lift the ones above
    # ours, drop ours, and put theirs back in the same order.
    above = []
    for _ in range(torch._C._len_torch_function_stack()):
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


# ------------------------------------------------------------------ callers

def caller(depth: int = 1) -> Optional[FrameType]:
    """The frame that made the torch call being handled: the innermost one
    outside torch, wrapt and amp_patch's op machinery (``depth`` frames up
    from the function asking)."""
    f: Optional[FrameType] = sys._getframe(depth + 1)
    while f is not None:
        if not (frames.is_library(f) or frames.is_machinery(f)):
            return f
        f = f.f_back
    return None


#: torch's utilities that a user calls on a model's parameters or gradients between
#: the forward and the step (``clip_grad_norm_``, ``clip_grad_value_``, ``get_total_norm``,
#: ``parameters_to_vector``, ...): the ops they run are the utility's, not the model's.
#: The modules a model's forward runs through (parametrize, weight_norm, spectral_norm,
#: prune, rnn, stateless) are not among them: their ops are the model's.
UTILITY_MODULES = frozenset((
    "torch.nn.utils.clip_grad", "torch.nn.utils.convert_parameters", "torch.nn.utils.fusion",
    "torch.nn.utils.memory_format", "torch.nn.utils._foreach_utils",
))


@functools.lru_cache(maxsize=1)
def _utility_names() -> Dict[object, str]:
    """``{code object: public name}`` of the functions ``torch.nn.utils`` exports
    from ``UTILITY_MODULES``, each under its decorators (``get_total_norm`` is a
    ``no_grad`` wrapper of ``_get_total_norm``; the wrapper's code is shared by
    every function so decorated, so only the innermost function's counts)."""
    out: Dict[object, str] = {}
    for name in dir(torch.nn.utils):
        obj = getattr(torch.nn.utils, name, None)
        if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) not in UTILITY_MODULES:
            continue
        for _ in range(8):
            if getattr(obj, "__wrapped__", None) is None:
                break
            obj = obj.__wrapped__
        code = getattr(obj, "__code__", None)
        if code is not None:
            out.setdefault(code, f"torch.nn.utils.{name}")
    return out


def caller_and_utility(depth: int = 1) -> Tuple[Optional["FrameType"], Optional[str]]:
    """``caller``'s frame, and the torch utility (``UTILITY_MODULES``) the call was
    made from inside of, by the name the script calls it by
    (``torch.nn.utils.clip_grad_norm_``), or None: of the public functions of
    those modules between the two frames, the outermost."""
    f: Optional[FrameType] = sys._getframe(depth + 1)
    utility: Optional[str] = None
    while f is not None:
        if not (frames.is_library(f) or frames.is_machinery(f)):
            return f, utility
        module = frames.module_name(f)
        if module in UTILITY_MODULES:
            name = _utility_names().get(f.f_code)
            if name is None and not f.f_code.co_name.startswith("_"):
                name = f"{module}.{f.f_code.co_name}"
            utility = name or utility
        f = f.f_back
    return None, utility


#: True when amp_patch itself (the loss scaler, model conversion) made the call
is_internal = frames.is_internal


def site(frame: Optional[FrameType]) -> str:
    """``file:line`` of ``frame``, or ``"?"``."""
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ------------------------------------------------------------------ names


class OpNames:
    """Public names of torch's functions, for one AMP run.

    ``names(func)`` gives every ``(namespace, name)`` that holds ``func``
    (``F.conv2d`` *is* ``torch.conv2d``), looking through amp_patch's own
    wrappers; ``covered(names)`` says whether any of them is in the op lists
    in force (or patched by a registration).
    """

    def __init__(self, patcher: "Patcher", table: Optional[Dict[tuple, "Entry"]]):
        #: the run's patched attributes: the originals behind its wrappers, and what a registration patched
        self.patcher = patcher
        #: ``{(namespace, name): Entry}`` of the op lists in force, or None
        self.table = table
        self._by_id: Optional[Dict[int, Tuple[Tuple[str, str], ...]]] = None
        self._keep: list = []  # keeps the indexed objects (and so their ids) alive

    def _build(self) -> Dict[int, Tuple[Tuple[str, str], ...]]:
        patcher = self.patcher
        by_id: Dict[int, Tuple[Tuple[str, str], ...]] = {}
        for ns, owner in NAMESPACES.items():
            for name in dir(owner):
                if name.startswith("_") and not name.startswith("__"):
                    continue
                objs = [getattr(owner, name, None)]
                if patcher.is_patched(owner, name):
                    objs.append(patcher.get_original(owner, name))
                for obj in objs:
                    if callable(obj) and not isinstance(obj, type):
                        by_id[id(obj)] = by_id.get(id(obj), ()) + ((ns, name),)
                        self._keep.append(obj)
        return by_id

    def names(self, func: object) -> Tuple[Tuple[str, str], ...]:
        if self._by_id is None:
            self._by_id = self._build()
        found = self._by_id.get(id(func))
        if found:
            return found
        # A Tensor method reached through an instance (ours arrives as a
        # method object over its wrapper) is named by its receiver's class.
        if isinstance(getattr(func, "__self__", None), torch.Tensor):
            name = getattr(func, "__name__", None)
            if isinstance(name, str) and hasattr(torch.Tensor, name):
                return (("torch.Tensor", name),)
        return ()

    def covered(self, names: Tuple[Tuple[str, str], ...]) -> bool:
        """Whether a list covers the op: under one of its names, or, for a Tensor
        method, under the operator that runs it (``a * b`` reaches torch as ``mul``)."""
        table = self.table or {}
        patcher = self.patcher
        keys = list(names) + [
            (ns, op) for ns, name in names if ns == "torch.Tensor" for op in OPERATOR_FORMS.get(name, ())
        ]
        return any(key in table or patcher.is_patched(NAMESPACES[key[0]], key[1]) for key in keys)


def qualname(key: Tuple[str, str]) -> str:
    return f"{key[0]}.{key[1]}"
