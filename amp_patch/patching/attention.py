"""Attention in FP32 where this machine's half attention is slower.

On a CPU without AMX, torch's half flash-attention backward is the slow part
of a small transformer's step: on an AVX512-BF16 EPYC the BF16 forward and
backward of a ``[8, 8, 128, 64]`` attention take 31 ms, the FP32 kernel on
the same inputs cast up 19 ms. Longer sequences turn it round (BF16 wins from
about 256 tokens with a causal mask there). So under ``cast_policy="auto"``
(the default at O2/O3/O5) a call of ``F.scaled_dot_product_attention`` on half
inputs runs torch's FP32 CPU flash kernel where that is measured faster:

* The decision is per shape class (query and key lengths rounded up to a
  power of two, at most ``LONGEST``, head size, causal, masked, dtype, thread count), timed once
  per process on a one-sample, eight-head attention of the class's size, its
  forward and backward, with a private generator (the user's random stream
  is untouched). FP32 is taken only when it wins by ``MARGIN``, so a
  near-tie, which could flip between runs, stays half.
* ``Fp32Attention`` casts the half inputs up, runs the FP32 kernel and
  returns its output in the inputs' dtype, so the model downstream sees what
  it saw. It saves the half inputs and output (and the kernel's FP32
  log-sum-exp), what the half kernel saves, so activation memory does not
  grow; its backward casts them up again. The result is at least as accurate
  as the half kernel's (tested).
* Anything else runs the original: CUDA, FP32 inputs, no gradient wanted
  (the forward alone is a tie), dropout, a differentiable mask, a causal
  flag with a mask, nested tensors, ``torch.compile`` tracing, unequal head
  sizes. A boolean mask becomes 0/-inf and
  grouped-query attention repeats the key and value heads, one slice at a
  time, as torch's own call does.

``decisions()`` lists what was measured and chosen; ``amp_patch.report()``
prints it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from .cast import LOW

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
f32 = torch.float32

#: the op this is about, by its public name (the op lists' key)
QUALNAME = "torch.nn.functional.scaled_dot_product_attention"
#: FP32 must take at most this share of the half kernel's time to be chosen
MARGIN = 0.85
#: a longer query or key takes the decision measured at this length (timing
#: the class itself would take seconds; the half kernel's standing only
#: improves with length: BF16 wins from a few hundred tokens, FP16 on a CPU
#: loses at every length)
LONGEST = 1024
_HEADS = 8
#: the options after query, key and value, in torch's order
_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

Key = Tuple[int, int, int, bool, bool, torch.dtype, int]
#: shape class -> (FP32 chosen, half ms, FP32 ms; the times None when taken from a
#: checkpoint); None where the FP32 kernel refused the class
_chosen: Dict[Key, Optional[Tuple[bool, Optional[float], Optional[float]]]] = {}
_lock = threading.Lock()
_UNSEEN = object()  # a class not measured yet (None in _chosen: measured, the FP32 kernel refused it)


#: FP32 elements of one tensor in one kernel call: the batch is taken in slices
#: this size, so the FP32 copies live one slice at a time and the step's peak
#: memory stays that of the half kernel
SLICE = 1 << 16


def _slices(q: Tensor, mask: Optional[Tensor]) -> Iterator[Tuple[slice, Optional[Tensor]]]:
    """Batch slices of about ``SLICE`` elements, each with its part of the mask
    in FP32. Attention is independent across the batch, so the slices' results
    are the whole call's, bit for bit."""
    b = q.shape[0]
    per = max(1, SLICE // max(1, q[0].numel()))
    split = mask is not None and mask.dim() == 4 and mask.shape[0] == b
    shared = None if split else _fp32_mask(mask)  # one mask for every slice: cast once
    for i in range(0, b, per):  # one slice's FP32 copies at a time
        yield slice(i, i + per), _fp32_mask(mask[i:i + per]) if split else shared


def _fp32_mask(mask: Optional[Tensor]) -> Optional[Tensor]:
    """The mask as the FP32 kernel takes it: a boolean one (True: attend) becomes
    0 and -inf, as torch's own attention converts it."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        return mask.float()
    return torch.zeros(mask.shape, dtype=f32, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


class Fp32Attention(torch.autograd.Function):
    """Scaled dot-product attention on half inputs, computed by the FP32 CPU
    flash kernel; output in the inputs' dtype. It saves the half tensors and
    the mask as given (boolean or any float dtype), each cast one slice at a time."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool,
                scale: Optional[float], groups: int = 1) -> Tensor:
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=f32)
        for s, m in _slices(q, mask):
            o, lse[s] = _flash(q[s].float(), _up(k[s], groups), _up(v[s], groups), 0.0, causal, attn_mask=m, scale=scale)
            out[s] = o
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale, ctx.groups = causal, scale, groups
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        q, k, v, out, lse, mask = ctx.saved_tensors
        groups = ctx.groups
        gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for s, m in _slices(q, mask):
            gq[s], gks, gvs = _flash_backward(grad[s].float(), q[s].float(), _up(k[s], groups), _up(v[s], groups),
                                              out[s].float(), lse[s], 0.0, ctx.causal, attn_mask=m, scale=ctx.scale)
            gk[s], gv[s] = _down(gks, groups), _down(gvs, groups)
        return gq, gk, gv, None, None, None, None


def _up(t: Tensor, groups: int) -> Tensor:
    """A key or value slice in FP32, each head repeated for its query group
    (grouped-query attention, as torch's ``enable_gqa=True`` repeats it)."""
    t = t.float()
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _down(g: Tensor, groups: int) -> Tensor:
    """The gradient of ``_up``: each group's heads summed back into their key/value head."""
    if groups == 1:
        return g
    b, h, n, e = g.shape
    return g.view(b, h // groups, groups, n, e).sum(2)


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


Call = Tuple[Tensor, Tensor, Tensor, Optional[Tensor], bool, Optional[float]]


def _parse(args: tuple, kwargs: Optional[dict]) -> Optional[Call]:
    """(q, k, v, mask, causal, scale) when the FP32 kernel can take this call
    (whatever the inputs' dtype) and gradients are wanted, else None."""
    if torch.compiler.is_compiling():
        return None  # traced: the half kernel goes into the graph, which stays whole
    if _flash is None or len(args) < 3 or len(args) > 8 or not torch.is_grad_enabled():
        return None
    q, k, v = args[0], args[1], args[2]
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if q.is_nested or k.is_nested or v.is_nested or q.layout != torch.strided:
        return None
    if q.device.type != "cpu" or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[1] == 0:
        return None
    opts = dict(zip(_ARGS, args[3:])) if len(args) > 3 else {}
    if kwargs:
        if any(name not in _ARGS or name in opts for name in kwargs):
            return None
        opts.update(kwargs)
    mask, causal, scale = opts.get("attn_mask"), opts.get("is_causal", False), opts.get("scale")
    if opts.get("dropout_p", 0.0) != 0.0 or not isinstance(causal, bool):
        return None
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not (opts.get("enable_gqa", False) is True and heads % kv_heads == 0):
        return None
    if scale is not None and not isinstance(scale, float):
        return None
    if mask is not None:
        if causal or not isinstance(mask, Tensor) or mask.requires_grad:
            return None
        if not (mask.is_floating_point() or mask.dtype == torch.bool):
            return None
        if mask.device.type != "cpu" or mask.dim() not in (2, 3, 4):
            return None
        if mask.dim() == 3:  # (heads or 1, query, key): the kernel takes 2 or 4 dimensions
            mask = mask.unsqueeze(0)
    return q, k, v, mask, causal, scale


def _measure(key: Key, original: Callable) -> Optional[Tuple[bool, float, float]]:
    """Time the half kernel and ``Fp32Attention``, forward and backward, on one
    sample of the class; None when the FP32 kernel refuses it."""
    lq, lk, e, causal, masked, dt, _ = key
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, _HEADS, n, e, generator=g).to(dt).requires_grad_() for n in (lq, lk, lk))
    dout = torch.randn(1, _HEADS, lq, e, generator=g).to(dt)
    mask = torch.zeros(1, 1, lq, lk) if masked else None
    half_mask = mask.to(dt) if mask is not None else None

    def half() -> None:
        torch.autograd.grad(original(q, k, v, attn_mask=half_mask, is_causal=causal), (q, k, v), dout)

    def fp32() -> None:
        torch.autograd.grad(Fp32Attention.apply(q, k, v, mask, causal, None), (q, k, v), dout)

    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        try:
            fp32()
        except RuntimeError:
            return None
        half()
        t_half, t_fp32 = time_pair(half, fp32, 5 if lq * lk <= 512 * 512 else 2)
    return t_fp32 <= MARGIN * t_half, t_half, t_fp32


def time_pair(a: Callable[[], Any], b: Callable[[], Any], rounds: int) -> Tuple[float, float]:
    """Milliseconds of ``a`` and of ``b``, alternated, the best of ``rounds`` each:
    a slow moment of a shared machine hits both."""
    best_a = best_b = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        a()
        best_a = min(best_a, time.perf_counter() - t)
        t = time.perf_counter()
        b()
        best_b = min(best_b, time.perf_counter() - t)
    return best_a * 1e3, best_b * 1e3


def fp32_wins(lq: int, lk: int, head: int, causal: bool, masked: bool, dt: torch.dtype, original: Callable) -> bool:
    """Whether attention of this shape class runs faster in FP32 than in ``dt``
    here (measured on first sight, then remembered for the process)."""
    key = (_bucket(min(lq, LONGEST)), _bucket(min(lk, LONGEST)), head, causal, masked, dt, torch.get_num_threads())
    found = _chosen.get(key, _UNSEEN)
    if found is _UNSEEN:
        with _lock:
            if key not in _chosen:
                found = _chosen[key] = _measure(key, original)
                if found is not None:
                    name = str(dt).replace("torch.", "")
                    log.info("amp_patch: attention of %d x %d tokens, head size %d%s runs in %s here "
                             "(forward and backward: %.2f ms in %s, %.2f ms in float32)",
                             key[0], key[1], head, ", causal" if causal else "",
                             "float32" if found[0] else name, found[1], name, found[2])
            found = _chosen[key]
    return found is not None and found[0]


def _chosen_call(original: Callable, args: tuple, kwargs: Optional[dict], dt: torch.dtype) -> Optional[Call]:
    """The call, parsed, when the FP32 kernel can take it and its class runs faster in FP32 than in ``dt``."""
    call = _parse(args, kwargs)
    if call is None:
        return None
    q, k, _, mask, causal, _ = call
    return call if fp32_wins(q.shape[2], k.shape[2], q.shape[3], causal, mask is not None, dt, original) else None


def attend(original: Callable, args: tuple, kwargs: Optional[dict]) -> Optional[Tensor]:
    """At O2/O3/O5: the FP32 kernel's result for a half call it can take and runs
    faster here, in the call's dtype; None otherwise (the caller runs ``original``)."""
    q = args[0] if args else None
    dt = q.dtype if isinstance(q, Tensor) else None
    if dt not in LOW or len(args) < 3 or getattr(args[1], "dtype", None) is not dt or getattr(args[2], "dtype", None) is not dt:
        return None  # an FP32 call (or none of ours) goes straight through
    call = _chosen_call(original, args, kwargs, dt)
    if call is None:
        return None
    q, k, v, mask, causal, scale = call
    try:
        return Fp32Attention.apply(q, k, v, mask, causal, scale, q.shape[1] // k.shape[1])
    except RuntimeError:
        # a form the FP32 kernel refuses (nothing was recorded): torch's own call
        # runs it, or raises its own error if the call is wrong
        return None


def keeps_fp32(original: Callable, args: tuple, kwargs: Optional[dict], half: torch.dtype) -> bool:
    """At O1/O4 under ``cast_policy="auto"``: whether this call, which the half
    list would run in ``half``, runs faster in FP32 here."""
    return _chosen_call(original, args, kwargs, half) is not None


def saved() -> List[list]:
    """The choices made so far, as plain values for ``amp_patch.state_dict()``:
    a run resumed from the checkpoint takes them instead of measuring again,
    so it computes what the first run computed."""
    return [[lq, lk, e, causal, masked, str(dt).replace("torch.", ""), threads, found[0]]
            for (lq, lk, e, causal, masked, dt, threads), found in _chosen.items() if found is not None]


def restore(rows: object) -> None:
    """Take the choices ``saved()`` returned (all or nothing: ValueError names a bad row)."""
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"attention choices must be a list, got {type(rows).__name__}")
    chosen = {}
    for i, row in enumerate(rows):
        ok = isinstance(row, (list, tuple)) and len(row) == 8
        if ok:
            lq, lk, e, causal, masked, dt, threads, fp32 = row
            ok = (all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (lq, lk, e, threads))
                  and all(isinstance(b, bool) for b in (causal, masked, fp32)) and dt in ("bfloat16", "float16"))
        if not ok:
            raise ValueError(f"attention choice {i} is {row!r}; expected [query_len, key_len, head_size, causal, "
                             f"masked, 'bfloat16' or 'float16', threads, runs_in_float32]")
        chosen[(lq, lk, e, causal, masked, getattr(torch, dt), threads)] = (fp32, None, None)
    with _lock:
        _chosen.update(chosen)


def decisions() -> List[Dict[str, Any]]:
    """What was measured this process: one dict per shape class."""
    rows = []
    for (lq, lk, e, causal, masked, dt, threads), found in sorted(_chosen.items(), key=str):
        rows.append({"query_len": lq, "key_len": lk, "head_size": e, "causal": causal, "masked": masked,
                     "dtype": dt, "threads": threads, "runs_in": None if found is None else (f32 if found[0] else dt),
                     "half_ms": None if found is None else found[1], "fp32_ms": None if found is None else found[2]})
    return rows
