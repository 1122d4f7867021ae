"""The cast helper and the weight-cast cache.

One recursive helper decides what a policy casts: floating tensors only, never
float64 (autocast leaves it alone too), never integer, bool or complex tensors,
and it recurses into tuples, lists and dicts. Containers are rebuilt only when
something inside them changed, so the common no-cast call allocates nothing.

The cache keeps the half-precision copy of an FP32 leaf tensor that requires
grad (an ``nn.Parameter``), so a weight used many times in one forward (an
RNN cell's loop, tied embeddings, a layer called twice) is cast once. An entry
is valid while the parameter's version counter and storage are unchanged: an
in-place edit, ``load_state_dict`` or an optimizer step bumps the version and
the next use casts again.

A write through ``.data`` (``p.data.mul_(0.5)``, ``p.data.copy_(ema)``: EMA
swaps for evaluation, pruning) bumps no version counter, so no check per hit
can see it. The cache therefore lives for one forward, as ``torch.autocast``'s
lives for one autocast region: it is emptied when the outermost forward of a
model given to ``initialize`` starts (``run.flight``), when any outermost
module call starts under the launcher and ``amp_patch.auto``, whose models
amp_patch does not know (``frontends.outputs``), and before and after each
backward (``scaling.patches``). Evaluation loops with no backward, several
forwards per step and ``torch.no_grad()`` evaluation all cast afresh at each
forward. None of this touches a patched op's call: a hit still costs the
checks below, a call that casts nothing never reaches the cache.
"""
from __future__ import annotations

__amp_patch_frame__ = "machinery"  # frames.py: the op call itself, never its caller

import copy
from typing import Any, Iterable, NamedTuple

import torch

Tensor = torch.Tensor
f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
LOW = (f16, bf16)
#: dtypes a policy may cast from or to; float64 is deliberately absent.
CASTABLE = frozenset((f16, bf16, f32))
#: tensor types whose half copies the cache may keep
_CACHEABLE = frozenset((Tensor, torch.nn.Parameter))
#: the conversion for each target dtype. ``TensorBase.bfloat16(t)`` is
#: ``t.to(torch.bfloat16)``, but skips ``to``'s overload resolution, which costs
#: more than the copy on small tensors (figures in benchmarks/RESULTS.md).
#: Taken from the C base class, which amp_patch never patches.
CONVERT = {f16: torch._C.TensorBase.half, bf16: torch._C.TensorBase.bfloat16, f32: torch._C.TensorBase.float}
_grad_enabled = torch._C.is_grad_enabled


class CacheEntry(NamedTuple):
    """One weight's cached copy, under ``id(tensor)`` in ``CastCache``'s map of
    its grad mode. It serves a cast while ``tensor`` is the same object, cast to
    the same dtype, and its version counter and data pointer are unchanged. The
    C fast path (``_fastpath.c``, ``cache_hit``) checks a hit by the same rule,
    reading these fields by position (checked at ``bind``)."""

    tensor: Tensor
    to: torch.dtype
    version: int
    data_ptr: int
    copy: Tensor


class CastCache:
    """Half copies of FP32 parameters, one entry per tensor and grad mode.

    A copy made under ``no_grad`` has no autograd history, so it must never
    serve a forward pass that needs gradients: the two modes have separate maps.
    """

    def __init__(self) -> None:
        # Indexed by torch.is_grad_enabled(). Plain dict operations are atomic
        # under the GIL; two threads racing on one entry both store a valid copy.
        self._maps = ({}, {})
        # [hits, misses]; a list, so the C fast path (_fastpath.c), which
        # checks hits itself, counts them in the same place.
        self.counts = [0, 0]

    @property
    def hits(self) -> int:
        return self.counts[0]

    @property
    def misses(self) -> int:
        return self.counts[1]

    def __len__(self) -> int:
        return len(self._maps[0]) + len(self._maps[1])

    def clear(self) -> None:
        self._maps[0].clear()
        self._maps[1].clear()

    def cast(self, t: Tensor, to: torch.dtype) -> Tensor:
        entries = self._maps[_grad_enabled()]
        entry = entries.get(id(t))
        # A hit is checked first: it is the common case for a weight. The
        # version counter catches in-place edits (optimizer steps,
        # load_state_dict); the data pointer catches `param.data = ...`;
        # requires_grad catches a weight frozen since.
        if (
            entry is not None and entry.tensor is t and entry.to is to and entry.version == t._version
            and entry.data_ptr == t.data_ptr() and t.requires_grad
        ):
            self.counts[0] += 1
            return entry.copy
        out = CONVERT[to](t)
        # Only leaves that require grad are cached, as autocast does: their
        # cast is the expensive, repeated one, and they are not views of
        # activations that change every call.
        # Tensor subclasses are not cached either: the FakeTensors and
        # FunctionalTensors torch.compile traces with have no storage to key on.
        # Nor are tensors with no storage: torch.func's wrappers (the inputs of a
        # function under grad, vmap or jacrev) are plain Tensors that requires_grad
        # and are leaves, made anew at each call, and their data_ptr() raises.
        if t.requires_grad and t.is_leaf and type(t) in _CACHEABLE:
            try:
                at = t.data_ptr()
            except RuntimeError:
                return out
            self.counts[1] += 1
            entries[id(t)] = CacheEntry(t, to, t._version, at, out)
        return out


def needs_cast(obj: object, to: torch.dtype) -> bool:
    """True if some castable floating tensor in ``obj`` is not already ``to``."""
    if isinstance(obj, Tensor):
        dt = obj.dtype
        return dt is not to and dt in CASTABLE
    if isinstance(obj, (list, tuple)):
        for x in obj:
            if needs_cast(x, to):
                return True
    elif isinstance(obj, dict):
        for x in obj.values():
            if needs_cast(x, to):
                return True
    return False


def cast(obj: object, to: torch.dtype, cache: CastCache | None, stats=None) -> Any:
    """Return ``obj`` with every castable floating tensor converted to ``to``.

    ``stats``, when given, is called as ``stats(nbytes)`` for each cast made
    (the op ledger); ``None`` costs nothing.
    """
    if isinstance(obj, Tensor):
        dt = obj.dtype
        if dt is to or dt not in CASTABLE:
            return obj
        if stats is not None:
            stats(obj.numel() * obj.element_size())
        if cache is not None and to is not f32 and obj.requires_grad and obj.is_leaf:
            return cache.cast(obj, to)
        return CONVERT[to](obj)
    if isinstance(obj, (list, tuple)):
        new = [cast(x, to, cache, stats) for x in obj]
        if all(a is b for a, b in zip(new, obj)):
            return obj
        if isinstance(obj, tuple):
            # namedtuples (e.g. PackedSequence) are rebuilt field by field, and
            # torch's structseq results (torch.max(x, dim) -> .values, .indices)
            # from the sequence, so their field names survive the cast
            if hasattr(obj, "_fields"):
                return type(obj)(*new)
            return type(obj)(new) if hasattr(type(obj), "n_sequence_fields") else tuple(new)
        return new
    if isinstance(obj, dict):
        changed = False
        out = {}
        for k, v in obj.items():
            nv = cast(v, to, cache, stats)
            changed = changed or nv is not v
            out[k] = nv
        if not changed:
            return obj
        if type(obj) is dict:
            return out
        # A dict subclass (an OrderedDict, a Hugging Face ModelOutput, whose
        # fields are attributes too) keeps its type: copy it, then set the items.
        new_obj = copy.copy(obj)
        for k, v in out.items():
            new_obj[k] = v
        return new_obj
    return obj


def cast_args(args: Iterable[object], to: torch.dtype, cache: CastCache | None) -> list:
    """``cast`` for a flat argument tuple, with tensors handled inline (the
    casting call path runs this on every call that casts)."""
    convert = CONVERT[to]
    if to is f32:
        cache = None  # the cache keeps half copies only
    out = []
    for a in args:
        if isinstance(a, Tensor):
            dt = a.dtype
            if dt is not to and dt in CASTABLE:
                # only a leaf that requires grad can be a cached weight
                a = cache.cast(a, to) if cache is not None and a.requires_grad and a.is_leaf else convert(a)
        elif isinstance(a, (list, tuple, dict)):
            a = cast(a, to, cache)
        out.append(a)
    return out
