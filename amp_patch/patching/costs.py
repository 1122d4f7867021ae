"""Cost-aware casting: ``initialize(..., cast_policy="auto")``.

Under O1/O4 every op on the half list runs in the half dtype, as under
``torch.autocast``. On small models that makes mixed precision slower than
FP32: casting the inputs (and, for the next FP32 op, the output) costs more
than the half matmul saves. With ``cast_policy="auto"`` a half-list matmul or
convolution whose work is below a FLOP threshold stays in FP32; larger ones
cast exactly as before. The threshold is measured once per process at
``initialize`` (``threshold``): a linear layer of growing size is timed in
FP32 and in the half dtype, casts of its input and output included, and the
threshold is the size where half starts to win. ``cast_policy="parity"``, the
default, keeps autocast's behaviour.

Only ops whose work can be read from their arguments take part (``FLOPS``),
and attention (``AutoAttention``: its shape class measured once in each dtype,
``attention.py``); the rest of the half list casts as always. The decision is
per call, from the shapes: for a matmul a few attribute reads on the call that
would otherwise cast, for attention a parse of its arguments and a table
look-up (on a call of milliseconds). With ``collect_stats=True`` the op ledger
counts the calls kept in FP32 and says why.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F


log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
f32 = torch.float32

from . import attention
from .cast import LOW


def _mm(a: object, b: object) -> Optional[float]:
    """2 * (rows of a) * (inner) * (columns of b), batch dimensions folded into a's rows."""
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() and b.dim():
        return 2.0 * a.numel() * (b.shape[-1] if b.dim() > 1 else 1)
    return None


#: how a sized op's FLOPs follow from its positional arguments; the C fast path
#: (``_fastpath.c``, ``small_call``) switches on the same codes, in the same
#: double arithmetic, and ``tests/patching/test_fastpath.py`` holds the two equal
LINEAR, MM, ADDMM, CONV = 1, 2, 3, 4


def flops(kind: int, args: tuple) -> Optional[float]:
    """The FLOPs of a call of an op counted by ``kind`` (``FLOPS``), None when
    its arguments do not give them."""
    if kind == ADDMM:  # addmm(bias, a, b), baddbmm(input, a, b)
        return _mm(args[1], args[2]) if len(args) > 2 else None
    if len(args) < 2:
        return None
    if kind == MM:
        return _mm(args[0], args[1])
    x, w = args[0], args[1]
    if not (isinstance(x, Tensor) and isinstance(w, Tensor)):
        return None
    if kind == LINEAR:  # linear(x, w): 2 * x.numel() * out_features
        return 2.0 * x.numel() * (w.shape[0] if w.dim() > 1 else 1) if w.dim() else None
    if kind == CONV and x.dim() > 1 and w.dim() > 1 and x.shape[1]:
        # stride 1: every input position meets every weight of its group
        return 2.0 * x.numel() / x.shape[1] * w.numel()
    return None


#: half-list ops whose FLOPs the positional arguments give, and how
FLOPS: Dict[str, int] = {
    "torch.nn.functional.linear": LINEAR,
    **{f"torch.nn.functional.conv{d}d": CONV for d in (1, 2, 3)},
    **{f"torch.conv{d}d": CONV for d in (1, 2, 3)},
    **{f"torch.{n}": MM for n in ("mm", "matmul", "bmm")},
    **{f"torch.Tensor.{n}": MM for n in ("mm", "matmul", "bmm", "__matmul__")},
    **{f"torch.{n}": ADDMM for n in ("addmm", "baddbmm", "addbmm")},
    **{f"torch.Tensor.{n}": ADDMM for n in ("addmm", "baddbmm", "addbmm")},
}


class Auto:
    """The planner of a half-list op under ``cast_policy="auto"``: the half
    planner's answer, except that a call under ``min_flops`` runs in FP32."""

    __slots__ = ("plan", "kind", "min_flops", "qualname")

    def __init__(self, plan: Callable, qualname: str, min_flops: float):
        self.plan, self.kind, self.min_flops, self.qualname = plan, FLOPS[qualname], min_flops, qualname

    def small(self, args: tuple, kwargs: Optional[dict]) -> Optional[float]:
        """The call's FLOPs when it is under the threshold, else None."""
        if kwargs and "out" in kwargs:
            return None
        n = flops(self.kind, args)
        return n if n is not None and n < self.min_flops else None

    def __call__(self, args: tuple, kwargs: Optional[dict]) -> Optional[torch.dtype]:
        to = self.plan(args, kwargs)
        if to is None or (kwargs and "out" in kwargs):
            return to
        n = flops(self.kind, args)
        if n is None or n >= self.min_flops:
            return to
        return _kept_fp32(args)

    def why(self, args: tuple, kwargs: Optional[dict]) -> str:
        """The ledger's reason for a call kept in FP32 ("" for one that was not)."""
        n = self.small(args, kwargs)
        if n is None or self.plan(args, kwargs) is None:
            return ""
        return f"{_flops_text(n)} < {_flops_text(self.min_flops)} (cast_policy='auto' threshold)"


class AutoAttention:
    """The planner of ``F.scaled_dot_product_attention`` under ``cast_policy="auto"``:
    the half planner's answer, except that a call whose shape class runs faster
    in FP32 here (``attention.keeps_fp32``, measured once per class) runs in FP32."""

    __slots__ = ("plan", "original", "half")

    def __init__(self, plan: Callable, original: Callable, half: torch.dtype):
        self.plan, self.original, self.half = plan, original, half

    def __call__(self, args: tuple, kwargs: Optional[dict]) -> Optional[torch.dtype]:
        # (attention has no out=, and a keyword the FP32 kernel does not know keeps the half planner's answer)
        if attention.keeps_fp32(self.original, args, kwargs, self.half):
            return _kept_fp32(args)
        return self.plan(args, kwargs)

    def why(self, args: tuple, kwargs: Optional[dict]) -> str:
        """The ledger's reason for a call kept in FP32 ("" for one that was not)."""
        if not attention.keeps_fp32(self.original, args, kwargs, self.half):
            return ""
        return "attention measured faster in float32 here (cast_policy='auto')"


def _kept_fp32(args: tuple) -> Optional[torch.dtype]:
    """The cast of a call kept in FP32: a half input (another op's output) is cast
    up, FP32 ones stay as they are (None: nothing to cast)."""
    for a in args:
        if isinstance(a, Tensor) and a.dtype in LOW:
            return f32
    return None


def auto_plan(plan: Callable, qualname: str, original: Callable, half: torch.dtype,
              min_flops: float) -> "Optional[Auto | AutoAttention]":
    """The planner of a ``half`` op under ``cast_policy="auto"``, or None for an
    op whose cost it cannot judge (it keeps its list's policy)."""
    if qualname in FLOPS:
        return Auto(plan, qualname, min_flops)
    if qualname == attention.QUALNAME:
        return AutoAttention(plan, original, half)
    return None


def _flops_text(n: float) -> str:
    if math.isinf(n):
        return "inf FLOP"
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOP"


@functools.lru_cache(maxsize=None)
def threshold(half: torch.dtype, device_type: str = "cpu", threads: int = 0) -> float:
    """The FLOPs from which a matmul is faster in ``half`` than in FP32 here, casts included.

    Measured once per process (and thread count): square ``F.linear`` calls of
    width 16, 32, ... 1024 in FP32 against the same call with its input cast
    to ``half`` before and its output cast to FP32 after (the weight's cast is
    cached across a step, so it is not counted). The threshold is the
    geometric mean of the FLOPs of the last size where FP32 won and the first
    of two in a row where half won; ``inf`` when half never won (the call then
    always stays FP32), 0 on a device this does not measure (CUDA: every call
    casts, as under ``"parity"``).
    """
    if device_type != "cpu":
        return 0.0
    g = torch.Generator().manual_seed(0)
    sizes = [16 * 2**k for k in range(7)]
    wins: list = []
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, n, generator=g)
            w = torch.randn(n, n, generator=g)
            wh = w.to(half)
            reps = max(3, min(50, int(2e7 / n**3)))
            fp32, low = attention.time_pair(lambda: F.linear(x, w), lambda: F.linear(x.to(half), wh).float(), reps)
            wins.append(low < fp32)
            if len(wins) >= 2 and wins[-1] and wins[-2]:
                break
    flops = [2.0 * n**3 for n in sizes[: len(wins)]]
    for i in range(1, len(wins)):
        if wins[i] and wins[i - 1]:
            first = i - 1
            return math.sqrt(flops[first - 1] * flops[first]) if first else flops[0]
    log.info("amp_patch: cast_policy='auto': %s never beat float32 on matmuls up to %d wide here; "
             "half-list matmuls stay float32", half, sizes[-1])
    return math.inf
