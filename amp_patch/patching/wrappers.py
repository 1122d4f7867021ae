"""Wrapper factories, one per casting policy, built on ``wrapt``.

Every wrapper has wrapt's signature ``(wrapped, instance, args, kwargs)``. A
*planner* looks at the arguments and returns the dtype to cast to, or ``None``
when nothing needs casting; then the wrapper calls straight through. That
no-cast path is the hot path: a few flag reads, the dtype checks, and the
call, with no allocation, formatting or logging.

Where the C fast path is built (``_fastpath.c``, see the end of this module),
``make_wrapper`` returns its wrapt subclasses for the ``half``, ``float`` and
``promote`` policies: their call does the common case (positional arguments,
casting on, no container) in C, with the same decisions, and hands any other
call to the Python wrapper below through wrapt, unchanged. (Attention under
``cast_policy="auto"`` is the exception: its planner parses the call and
looks up a measured choice, so it has the Python wrapper alone.)

A Tensor method's wrapper receives its receiver as ``args[0]`` (see
``MethodWrapper``) and calls the unbound original, so casting the receiver is
casting an argument, and one wrapper serves functions and methods alike.

Policies:
  * ``half``     - run in the low-precision dtype (FP16 or BF16)
  * ``float``    - run in FP32
  * ``promote``  - run in the dtype torch's type promotion gives the inputs
                   (``torch.result_type``): the widest floating dtype among
                   the dimensioned tensors; a 0-dim tensor or a Python scalar
                   counts only where no dimensioned tensor is floating
  * ``sequence_promote`` - the same, for a list argument (``cat``, ``stack``)
  * ``banned``   - FP16: raise ``BannedOpError`` naming the fix;
                   BF16: resolved to ``float`` before a wrapper is built.

Refinements of a policy that hang on the op, not on the list (see
``NATIVE_PROMOTE``, ``UNDER_CPU_AUTOCAST`` and ``CONDITIONS``): promote ops
whose kernels promote mixed inputs themselves are never cast, the RNN kernels
run under CPU autocast where that keeps their recurrent state as autocast
keeps it, and an op whose kernel depends on an argument (``F.pad``'s mode) is
cast only for the kernels the policy is about.
"""
from __future__ import annotations

__amp_patch_frame__ = "machinery"  # frames.py: the op call itself, never its caller

import logging
import os
import sys
from threading import get_ident
from types import CodeType, FrameType, MethodType, ModuleType
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
import wrapt

from ..base import frames
from ..oplists.schema import is_inplace
from . import attention, costs
from .spec import NATIVE, Casting, OpSpec, op_spec
from .cast import CASTABLE, LOW, CacheEntry, cast, cast_args, needs_cast
from ..base.errors import BannedOpError, CastError

f32 = torch.float32
Tensor = torch.Tensor

# Threads inside disable_casts(): {thread ident: depth}. A plain dict, empty in
# the common case, so the hot path pays one truthiness test (a threading.local
# attribute read costs several times more).
disabled: dict = {}


class _Switch:
    """Read-only view of this thread's ``disable_casts()`` depth (``switch.off``)."""

    @property
    def off(self) -> int:
        return disabled.get(get_ident(), 0)


switch = _Switch()

# Non-empty while every patched call must run the Python wrappers, never the C
# fast path: overflow provenance finds the op being cast from their frames
# (``need_python``: ``amp_patch.diagnostics.modes`` asks while the watching mode has
# observers). The C fast path reads it (``_fastpath.c``): a dict, filled only here.
python_only: dict = {}


def need_python(reason: str, on: bool = True) -> None:
    """Make every patched call take the Python wrappers (``on``) for ``reason``, or
    stop asking; the C fast path comes back when no reason is left."""
    if on:
        python_only[reason] = True
    else:
        python_only.pop(reason, None)


def op_on_stack(frame: Optional[FrameType]) -> Tuple[bool, object]:
    """``(True, op)`` for the innermost casting wrapper running on the stack from
    ``frame`` outwards (every wrapper has wrapt's signature: its ``wrapped`` is the
    op), ``(False, None)`` when none is. Walks frames: for rare calls only."""
    f = frame
    while f is not None:
        if f.f_code in _WRAPPER_CODES:
            return True, f.f_locals.get("wrapped")
        f = f.f_back
    return False, None


class Live:
    """Whether the session that built a wrapper is still running.

    ``deinitialize`` turns it off. A module imported while torch was patched
    may have kept a reference to one of our wrappers (inductor's extern
    kernels take ``torch.mm`` and ``torch.convolution`` at import); once its
    session is over such a wrapper calls straight through, so it behaves as
    the function it wraps.
    """

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = True


#: for wrappers that belong to no session
ALWAYS = Live()


def push_disabled() -> None:
    ident = get_ident()
    disabled[ident] = disabled.get(ident, 0) + 1


def pop_disabled() -> None:
    ident = get_ident()
    depth = disabled.get(ident, 0) - 1
    if depth > 0:
        disabled[ident] = depth
    else:
        disabled.pop(ident, None)


_MIXED = object()


def _scan(obj: object, seen: object) -> object:
    """Fold the castable dtypes of ``obj`` into ``seen``: None, a dtype, or _MIXED."""
    if isinstance(obj, Tensor):
        dt = obj.dtype
        if dt in CASTABLE:
            if seen is None:
                return dt
            if dt is not seen:
                return _MIXED
        return seen
    if isinstance(obj, (list, tuple)):
        for x in obj:
            seen = _scan(x, seen)
            if seen is _MIXED:
                return _MIXED
    elif isinstance(obj, dict):
        for x in obj.values():
            seen = _scan(x, seen)
            if seen is _MIXED:
                return _MIXED
    return seen


def _promote_target(obj: object) -> Optional[torch.dtype]:
    """The castable dtype ``torch.result_type`` gives the tensors in ``obj``.

    Only called on a mix of castable dtypes (the cast path). Dimensioned
    tensors decide; 0-dim tensors count only where no dimensioned tensor is
    castable, as in torch's own promotion (``bf16_matrix * fp32_scalar_tensor``
    stays BF16). Python scalars never decide a floating result.
    """
    dims = zero = None
    for t in _tensors(obj):
        dt = t.dtype
        if dt not in CASTABLE:
            continue
        if t.dim():
            dims = dt if dims is None or dims is dt else f32
        else:
            zero = dt if zero is None or zero is dt else f32
    return dims if dims is not None else zero


def tensors_in(obj: object) -> Iterator[Tensor]:
    """Every tensor in ``obj``: itself, or inside nested lists, tuples and dicts."""
    return _tensors(obj)


def _tensors(obj: object) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


#: promote ops whose torch kernel promotes mixed floating inputs itself and
#: computes in the promoted dtype (TensorIterator ops, ``cat``): casting the
#: half operand first would copy it and give the same bits, so these are never
#: cast. The others (``dot``, ``index_put``, ``bilinear``...) refuse mixed
#: dtypes and are cast to the promoted dtype.
NATIVE_PROMOTE = frozenset(
    [f"torch.Tensor.{n}" for n in (
        "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
        "addcmul", "addcdiv", "atan2",
    )]
    + [f"torch.{n}" for n in (
        "addcmul", "addcdiv", "atan2", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
    )]
)

#: RNN kernels whose recurrent state CPU autocast keeps in FP32 (GRU, plain
#: RNNs and the cells run their state arithmetic with FP32 ``hx``, casting it
#: per step for the matmul only; LSTM's oneDNN kernel casts it). Under BF16 on
#: CPU they run under ``torch.autocast("cpu")``, which gives exactly that; on
#: CUDA, cuDNN under autocast casts the state to half, which the ``half``
#: policy does, and CPU autocast has no FP16 RNN kernels to follow.
UNDER_CPU_AUTOCAST = frozenset(
    [f"torch._VF.{n}" for n in (
        "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    )]
    + [f"torch.{n}" for n in ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")]
)


def _pad_reaches_listed_kernel(args, kwargs) -> bool:
    """``F.pad`` reaches ``reflection_pad1d/2d`` or ``replication_pad*``:
    the padding kernels CPU autocast runs in FP32 (constant and circular
    padding, and 3-D reflection, have no policy there)."""
    mode = args[2] if len(args) > 2 else (kwargs or {}).get("mode", "constant")
    if mode == "replicate":
        return True
    pad = args[1] if len(args) > 1 else (kwargs or {}).get("pad", ())
    return mode == "reflect" and len(pad) < 6


#: ops whose policy applies only to some calls: a predicate over (args, kwargs)
CONDITIONS = {"torch.nn.functional.pad": _pad_reaches_listed_kernel}


# ---------------------------------------------------------------- planners
# A planner returns the dtype to cast every castable input to, or None. For a
# Tensor method the receiver is ``args[0]``, so one planner serves both forms.


def _fixed_planner(to: torch.dtype) -> Callable:
    castable = CASTABLE - {to}

    def plan(args, kwargs):
        # An explicit out= tensor fixes the result's dtype: such calls are not
        # cast (autocast's rule too).
        if kwargs and "out" in kwargs:
            return None
        # Flat arguments are scanned inline: this runs on every call.
        for a in args:
            if isinstance(a, Tensor):
                if a.dtype in castable:
                    return to
            elif isinstance(a, (list, tuple, dict)) and needs_cast(a, to):
                return to
        if kwargs and needs_cast(kwargs, to):
            return to
        return None

    return plan


def _promote_plan(args, kwargs):
    if kwargs and "out" in kwargs:
        return None
    seen = _scan(args, None)
    if kwargs and seen is not _MIXED:
        seen = _scan(kwargs, seen)
    # One castable dtype needs nothing; a mix runs in torch's promoted dtype.
    return _promote_target((args, kwargs)) if seen is _MIXED else None


def _never(args, kwargs):
    return None


def make_planner(policy: str, half: torch.dtype, qualname: str = "") -> Callable:
    if policy == "half":
        plan = _fixed_planner(half)
    elif policy == "float":
        plan = _fixed_planner(f32)
    elif policy in ("promote", "sequence_promote"):
        plan = _never if qualname in NATIVE_PROMOTE else _promote_plan
    else:
        raise ValueError(policy)
    applies = CONDITIONS.get(qualname)
    if applies is None:
        return plan
    return lambda args, kwargs: plan(args, kwargs) if applies(args, kwargs) else None


# ---------------------------------------------------------------- wrapt types

_WrapperBase = wrapt.FunctionWrapper.__bases__[0]


class OpWrapper(wrapt.FunctionWrapper):
    """The wrapt wrapper amp_patch puts on a torch function.

    ``wrapt.FunctionWrapper`` gives a plain Python function (most of
    ``torch.nn.functional``) its "function" binding, under which every call
    first looks up ``__self__`` on the wrapped function; a plain function has
    none, so each call raises and clears an AttributeError. The
    "staticmethod" binding skips that lookup and binds the same way when the
    function is reached as a class attribute (the wrapper then gets the bound
    function as ``wrapped`` and its receiver as ``instance``).
    """

    def __init__(self, wrapped: Callable[..., Any], wrapper: Callable) -> None:
        _WrapperBase.__init__(self, wrapped, None, wrapper, None, "staticmethod")

    def __get__(self, obj: object, owner: Optional[type] = None) -> Any:
        # A builtin (torch.mm, F.linear) is no descriptor: kept as a class
        # attribute (``act = torch.tanh``) it stays unbound, as it is unpatched.
        if not hasattr(type(self.__wrapped__), "__get__"):
            return self
        return _WrapperBase.__get__(self, obj, owner)


class MethodWrapper(OpWrapper):
    """The wrapt wrapper on a ``torch.Tensor`` method or operator.

    Reached through a tensor, a ``FunctionWrapper`` builds a new
    ``BoundFunctionWrapper`` on every access, a large share of each ``x + y``.
    This one binds as a Python function does: ``x.add`` is a method object
    over the wrapper, which is then called with the receiver as ``args[0]``,
    exactly as ``torch.Tensor.add(x, y)`` calls it, and passes the same
    arguments to the unbound original.
    """

    def __get__(self, obj: object, owner: Optional[type] = None) -> Any:
        return self if obj is None else MethodType(self, obj)


# ---------------------------------------------------------------- factories


def make_wrapper(
    policy: str,
    qualname: str,
    original: Callable[..., Any],
    *,
    method: bool,
    casting: Casting,
    fix: str = "",
) -> wrapt.FunctionWrapper:
    """Build the wrapt wrapper that applies ``policy`` to ``original``.

    Args:
        policy: one of ``POLICIES`` (``banned`` under BF16 must be resolved to
            ``float`` by the caller).
        qualname: the op's public name, e.g. ``torch.nn.functional.linear``.
        original: the unwrapped callable (unbound for Tensor methods).
        method: True for a ``torch.Tensor`` attribute (the receiver is cast too).
        casting: the session's build inputs (``spec.Casting``): its half dtype,
            weight-cast cache, ``Live`` flag (the wrapper calls straight through
            once it is off), op ledger (None costs nothing) and, under
            ``cast_policy="auto"``, the FLOP threshold under which a ``half`` op
            of ``costs.FLOPS`` runs in FP32 (and attention where its half kernel
            is slower here, ``costs.auto_plan``).
        fix: for ``banned``, what to use instead.
    """
    kind = MethodWrapper if method else OpWrapper
    half, cache, ledger, live = casting.half, casting.cache, casting.ledger, casting.live
    if policy == "banned":
        return kind(original, _banned(qualname, half, fix, live))
    name = qualname.rpartition(".")[2]
    plan = make_planner(policy, half, qualname)
    inplace_at = None if is_inplace(name) else _inplace_parameter(original)
    min_flops = casting.min_flops
    auto = costs.auto_plan(plan, qualname, original, half, min_flops) if min_flops and policy == "half" else None
    if auto is not None:
        plan = auto
    sized = isinstance(auto, costs.Auto)  # a call's FLOPs, which the C path reads itself
    if is_inplace(name):
        # ``x.exp_()`` and ``torch.exp_(x)`` alike: the receiver is args[0]
        fn = _inplace(policy, qualname, live, ledger)
    elif inplace_at is not None:
        # F.relu(x, inplace=True) and its kin: no C fast path, every call is checked
        inner = _instrumented(qualname, policy, plan, cache, ledger, live) if ledger is not None else _general(plan, cache, live)
        return kind(original, _keyword_inplace(inner, inplace_at))
    elif ledger is not None:
        fn = _instrumented(qualname, policy, plan, cache, ledger, live)
    elif qualname in CONDITIONS:
        fn = _general(plan, cache, live)
    elif auto is not None and not sized:  # attention: one call is milliseconds of work, no C path needed
        return kind(original, _general(plan, cache, live))
    else:
        # One frozen spec, read by the Python wrapper below and by the C fast path
        spec = op_spec(policy, qualname, casting, native=policy not in ("half", "float") and qualname in NATIVE_PROMOTE,
                       sized=sized)
        general = _general(plan, cache, live)
        fn = _call_through if spec.mode == NATIVE else _positional(original, plan, general, spec)
        if fast and not (policy == "half" and qualname in UNDER_CPU_AUTOCAST):
            # The same decisions with the common call's check in C (_fastpath.c);
            # any other call still reaches ``fn`` through wrapt.
            kind = fast.FastMethodWrapper if method else fast.FastOpWrapper
            return kind(original, fn, spec)
    if policy == "half" and qualname in UNDER_CPU_AUTOCAST and half is torch.bfloat16:
        fn = _under_cpu_autocast(fn, half, live, ledger, qualname)
    return kind(original, fn)


# Every wrapper below has wrapt's signature (wrapped, instance, args, kwargs).
# ``instance`` is None except for a Python function reached as a class
# attribute, where ``wrapped`` is the bound function; the receiver of a Tensor
# method is ``args[0]`` (see MethodWrapper).
#
# The op's decision is its planner's (``make_planner``), written once in Python;
# ``_positional`` serves the common call with it, and the C fast path decides
# the same call from the same ``OpSpec``.


def _inplace_parameter(original) -> Optional[int]:
    """The position of an ``inplace`` parameter of a Python function (``F.relu``,
    ``F.dropout``), or None."""
    code = getattr(original, "__code__", None)
    if code is None:
        return None
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    return names.index("inplace") if "inplace" in names else None


def _keyword_inplace(inner, at):
    """An op in-place by its ``inplace`` argument stays in place after any
    policy: it computes as ``inner`` decides (on a cast copy when its policy
    casts), and the result is written back into the receiver, whose dtype it
    keeps, as the same call in plain torch would have changed it."""

    def wrapper(wrapped, instance, args, kwargs):
        flag = kwargs.get("inplace", False) if "inplace" in kwargs else (len(args) > at and args[at])
        out = inner(wrapped, instance, args, kwargs)
        if flag and args and isinstance(args[0], Tensor) and out is not args[0] and isinstance(out, Tensor):
            return args[0].copy_(out)
        return out

    return wrapper


def _positional(original, plan, general, spec):
    """The common call (positional arguments only, casting on, the session live,
    not bound) decided by the op's planner and made without an empty
    ``**kwargs``; any other call goes to ``general``. Where the C fast path is
    built it makes this call itself, from the same ``spec``."""
    cache, live = spec.weights, spec.live

    def wrapper(wrapped, instance, args, kwargs):
        if kwargs or disabled or instance is not None or not live.on:
            return general(wrapped, instance, args, kwargs)
        to = plan(args, None)
        if to is None:
            return original(*args)
        return original(*cast_args(args, to, cache))

    return wrapper


def _call_through(wrapped, instance, args, kwargs):
    """A ``NATIVE_PROMOTE`` op: its kernel promotes as the policy would."""
    return wrapped(*args, **kwargs)


def _under_cpu_autocast(fn, half, live, ledger, qualname):
    """An ``UNDER_CPU_AUTOCAST`` RNN kernel under BF16: on a CPU input it runs
    under ``torch.autocast("cpu")``, which casts the input and weights for
    its matmuls and keeps an FP32 recurrent state FP32; elsewhere ``fn``."""
    record = ledger.record if ledger is not None else None

    def wrapper(wrapped, instance, args, kwargs):
        if (disabled and get_ident() in disabled) or not live.on or not args:
            return fn(wrapped, instance, args, kwargs)
        x = args[0]
        if not (isinstance(x, Tensor) and x.device.type == "cpu"):
            return fn(wrapped, instance, args, kwargs)
        with torch.autocast("cpu", dtype=half):
            out = wrapped(*args, **kwargs)
        if record is not None:
            record(qualname, "half", out, 0, 0)
        return out

    return wrapper


def _general(plan, cache, live):
    def wrapper(wrapped, instance, args, kwargs):
        if (disabled and get_ident() in disabled) or not live.on:
            return wrapped(*args, **kwargs)
        to = plan(args, kwargs)
        if to is None:
            return wrapped(*args, **kwargs)
        if kwargs:
            kwargs = cast(kwargs, to, cache)
        return wrapped(*cast_args(args, to, cache), **kwargs)

    return wrapper


def attention_wrapper(original: Callable[..., Any], live: Live = ALWAYS) -> wrapt.FunctionWrapper:
    """``F.scaled_dot_product_attention`` at O2/O5 under ``cast_policy="auto"``.

    These levels patch no function; this is the one exception, and it casts
    nothing the caller sees: a half call that the FP32 kernel runs faster here
    (``attention``) returns the same dtype, every other call goes straight through.
    """
    def wrapper(wrapped, instance, args, kwargs):
        if not (disabled and get_ident() in disabled) and live.on:
            out = attention.attend(wrapped, args, kwargs)
            if out is not None:
                return out
        return wrapped(*args, **kwargs)

    return OpWrapper(original, wrapper)


def _inplace(policy, qualname, live, ledger=None):
    """In-place ops: the receiver keeps its dtype, the others follow it.

    The receiver is ``args[0]`` for a Tensor method (see MethodWrapper) and
    for a function such as ``torch.exp_``. Under ``float`` a half receiver is
    refused, as apex.amp refused it: the op cannot make it FP32 in place, and
    running it in half would drop the precision its policy asks for.
    """
    record = ledger.record if ledger is not None else None

    def wrapper(wrapped, instance, args, kwargs):
        if (disabled and get_ident() in disabled) or not live.on or not args or not isinstance(args[0], Tensor):
            return wrapped(*args, **kwargs)
        receiver, rest = args[0], args[1:]
        to = receiver.dtype
        if policy == "float" and to in LOW and not _called_from_torch():
            raise CastError(
                f"{qualname} runs in float32 under amp_patch, but it is in-place on a "
                f"{to} tensor, whose dtype it cannot change. Call it on a float32 tensor "
                f"(x = x.float()), use the out-of-place form, or wrap the call in "
                f"amp_patch.disable_casts()."
            )
        if not (to in CASTABLE and (needs_cast(rest, to) or (kwargs and needs_cast(kwargs, to)))):
            out = wrapped(*args, **kwargs)
            if record is not None:
                record(qualname, policy, out, 0, 0)
            return out
        if record is None:
            return wrapped(receiver, *cast(rest, to, None), **cast(kwargs, to, None))
        n = _Counter()
        out = wrapped(receiver, *cast(rest, to, None, n), **cast(kwargs, to, None, n))
        record(qualname, policy, out, n.casts, n.nbytes)
        return out

    return wrapper


def _called_from_torch() -> bool:
    """True when torch's own code made the call being refused.

    torch runs in-place ops on half tensors on purpose (``nn.init``'s
    truncated normal, fused losses that exponentiate half logits in place);
    those run as they do under ``torch.autocast``, which never touches
    in-place ops. Only reached on the path that would raise.
    """
    f = sys._getframe(2)
    while f is not None and (f.f_globals is _GLOBALS or frames.module_name(f).startswith("wrapt")):
        f = f.f_back
    return f is not None and frames.is_torch(f)


def _banned(qualname, half, fix, live):
    def wrapper(wrapped, instance, args, kwargs):
        if (disabled and get_ident() in disabled) or not live.on:
            return wrapped(*args, **kwargs)
        raise BannedOpError(
            f"{qualname} is unsafe in {half} and amp_patch refuses to run it while casting is on. "
            f"{fix} To call it anyway, run it in FP32 inside `with amp_patch.disable_casts():` "
            f"on float32 inputs, or move it to the float list of a YAML override."
        )

    return wrapper


class _Counter:
    """The casts one call made, for the op ledger: ``cast(..., stats=counter)`` calls it."""

    __slots__ = ("casts", "nbytes")

    def __init__(self) -> None:
        self.casts = self.nbytes = 0

    def __call__(self, nbytes: int) -> None:
        self.casts += 1
        self.nbytes += nbytes


def _instrumented(qualname, policy, plan, cache, ledger, live):
    """The same call path with the op ledger recording it (``collect_stats``)."""
    record = ledger.record
    why = getattr(plan, "why", None)  # costs.Auto / AutoAttention: why a call stayed FP32

    def wrapper(wrapped, instance, args, kwargs):
        if (disabled and get_ident() in disabled) or not live.on:
            return wrapped(*args, **kwargs)
        to = plan(args, kwargs)
        kept = why(args, kwargs) if why is not None else ""
        if to is None:
            out = wrapped(*args, **kwargs)
            record(qualname, policy, out, 0, 0, kept)
            return out
        n = _Counter()
        out = wrapped(*cast(args, to, cache, n), **cast(kwargs, to, cache, n))
        record(qualname, policy, out, n.casts, n.nbytes, kept)
        return out

    return wrapper


def wrapt_has_c_extension() -> bool:
    """True when ``wrapt.FunctionWrapper`` is wrapt's C type, not its pure-Python fallback."""
    try:
        from wrapt import _wrappers
    except ImportError:
        return False
    return wrapt.FunctionWrapper is getattr(_wrappers, "FunctionWrapper", None)


class _FastPathModule(ModuleType):
    """The C fast path's module, which says in words that it is in use when printed."""

    def __repr__(self) -> str:
        return f"the C fast path is in use: patched ops make their common call in C ({self.__file__})"


class NoFastPath:
    """``fast`` where the C fast path is not in use: false, and printed as the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"the C fast path is not in use: patched ops run the pure-Python wrappers, slower per call ({self.reason})"


# The C fast path (built from _fastpath.c when a compiler was there at install;
# AMP_PATCH_PURE_PYTHON=1 turns it off, to compare or to debug). It imports no
# amp_patch module: ``bind`` hands it the two switches it reads on every call
# (``disabled``, ``python_only``) and the layouts it reads by position, which it
# checks. ``print(fast)`` says which is in use; code asks ``if fast:``.
FAST_UNAVAILABLE = ""
fast: Any
if os.environ.get("AMP_PATCH_PURE_PYTHON", "") not in ("", "0"):
    FAST_UNAVAILABLE = "AMP_PATCH_PURE_PYTHON is set"
else:
    try:
        from . import _fastpath as fast

        fast.bind(disabled, python_only, OpSpec._fields, CacheEntry)
        fast.__class__ = _FastPathModule
    except ImportError as exc:  # no compiler at install, or wrapt without its C extension
        FAST_UNAVAILABLE = str(exc)
if FAST_UNAVAILABLE:
    fast = NoFastPath(FAST_UNAVAILABLE)
    logging.getLogger("amp_patch").debug(
        "amp_patch: patched ops run the pure-Python wrappers (slower per call): %s", FAST_UNAVAILABLE
    )


_GLOBALS = globals()  # identifies this module's frames (the wrappers) on a stack


def _wrapper_codes() -> frozenset:
    """The code of every casting wrapper (wrapt's signature: its ``wrapped`` is the
    op), each factory's inner ``wrapper`` and ``_call_through``: ``op_on_stack``
    knows a wrapper's frame by its code."""
    factories = (_keyword_inplace, _positional, _under_cpu_autocast, _general, attention_wrapper, _inplace, _banned,
                 _instrumented)
    codes = {_call_through.__code__}
    for factory in factories:
        codes.update(c for c in factory.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "wrapper")
    if len(codes) != len(factories) + 1:  # each factory makes exactly one wrapper
        raise ImportError("amp_patch.patching.wrappers: a wrapper factory's inner function is not named 'wrapper'")
    return frozenset(codes)


_WRAPPER_CODES = _wrapper_codes()
