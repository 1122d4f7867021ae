"""Per-call cost of a patched op on tiny tensors (dispatch overhead, not math).

For F.linear (on a plain input, and on an activation that requires grad, as
in training), torch.mm, F.mse_loss (a Python function, FP32 policy) and
Tensor.__add__ on 8x8 tensors it measures:
  * the unpatched op on inputs already in the dtype its policy runs it in,
  * the patched op on the same inputs (nothing to cast: the overhead), with
    the C fast path (``amp_patch/patching/_fastpath.c``) and with the pure-Python
    wrappers that run where it was not built,
  * the patched op on inputs it must cast, next to the unpatched op on the
    same inputs under torch.autocast (the reference). Autocast does not
    cover ``add``; its reference is the native mixed-dtype add, which promotes
    in C++ as the promote policy does.

A shared machine swings single timings by 1.5x and more, so figures are
paired: each round times every call once unpatched and once patched
(``initialize`` / ``deinitialize`` in between), all within a few
milliseconds, in short blocks measured in the thread's CPU time; the overhead
(patched minus unpatched) and the ratio (casting over reference) are taken
per round, and every figure is the median over rounds. Operators are timed as
operators (``x + y``), so the unpatched figure is torch's own slot. Run:

    python benchmarks/micro_overhead.py [--dtype bfloat16|float16] [--rounds 60] [--markdown]
"""
from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
import torch.nn.functional as F
import wrapt

import amp_patch
from amp_patch.patching import wrappers


def _cases(half: torch.dtype):
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    w = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.randn(8))
    xh, wh, bh = x.to(half), w.detach().to(half), b.detach().to(half)
    y = torch.randn(8, 8)
    # an activation as in training: it requires grad and is not a leaf
    act = torch.randn(8, 8, requires_grad=True) * 1.0
    acth = act.detach().to(half).requires_grad_()
    # (name, no-cast call, casting call, autocast covers it); the calls look the op up at call time, so the same lambda times the
    # patched and the unpatched op.
    return [
        ("F.linear", lambda: F.linear(xh, wh, bh), lambda: F.linear(x, w, b), True),
        ("F.linear, activation", lambda: F.linear(acth, wh, bh), lambda: F.linear(act, w, b), True),
        ("torch.mm", lambda: torch.mm(xh, wh), lambda: torch.mm(x, w), True),
        # a Python function (most of torch.nn.functional), run in FP32
        ("F.mse_loss", lambda: F.mse_loss(x, y), lambda: F.mse_loss(xh, wh), True),
        ("Tensor.__add__", lambda: xh + wh, lambda: x + wh, False),
    ]


def _block(fn, number: int) -> float:
    """µs per call, best of three short blocks, in this thread's CPU time (time
    the thread spends descheduled by other work on the machine is not counted)."""
    return min(timeit.repeat(fn, number=number, repeat=3, timer=time.thread_time)) / number * 1e6


def measure(half: torch.dtype, rounds: int = 60, number: int = 100):
    """Each round times every figure once, unpatched then patched, within a few
    milliseconds; the overhead and the ratio are taken per round, and every
    figure reported is the median over rounds."""
    cases = _cases(half)
    kinds = ("unpatched", "reference", "patched", "casting", "py_patched", "py_casting")
    per_round = {(name, k): [] for name, *_ in cases for k in kinds}
    fast = wrappers.fast
    for _ in range(rounds):
        for name, nocast, casting, covered in cases:
            per_round[(name, "unpatched")].append(_block(nocast, number))
            if covered:
                with torch.autocast("cpu", dtype=half):
                    per_round[(name, "reference")].append(_block(casting, number))
            else:
                per_round[(name, "reference")].append(_block(casting, number))
        for prefix, types in (("", fast), ("py_", None)):
            wrappers.fast = types  # the wrapper types initialize builds
            amp_patch.initialize(None, None, "O1", half_dtype=half, verbosity=0)
            try:
                for name, nocast, casting, _ in cases:
                    per_round[(name, prefix + "patched")].append(_block(nocast, number))
                    per_round[(name, prefix + "casting")].append(_block(casting, number))
            finally:
                amp_patch.deinitialize()
                wrappers.fast = fast
    med = statistics.median
    rows = []
    for name, _, _, covered in cases:
        r = {k: per_round[(name, k)] for k in kinds}
        rows.append(
            dict(
                op=name,
                unpatched_us=med(r["unpatched"]),
                patched_nocast_us=med(r["patched"]),
                overhead_us=med([b - a for a, b in zip(r["unpatched"], r["patched"])]),
                py_overhead_us=med([b - a for a, b in zip(r["unpatched"], r["py_patched"])]),
                patched_cast_us=med(r["casting"]),
                reference_us=med(r["reference"]),
                ratio_to_reference=med([c / d for c, d in zip(r["casting"], r["reference"])]),
                py_ratio_to_reference=med([c / d for c, d in zip(r["py_casting"], r["reference"])]),
                reference="torch.autocast" if covered else "native mixed-dtype op",
            )
        )
    return rows


def to_markdown(rows, half) -> str:
    lines = [
        f"| op ({str(half).split('.')[-1]}, 8x8) | unpatched µs | patched, no cast µs | overhead µs | "
        f"overhead, pure Python µs | patched, casting µs | reference µs | casting / reference | "
        f"casting / reference, pure Python | reference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['unpatched_us']:.2f} | {r['patched_nocast_us']:.2f} | {r['overhead_us']:.2f} | "
            f"{r['py_overhead_us']:.2f} | {r['patched_cast_us']:.2f} | {r['reference_us']:.2f} | "
            f"{r['ratio_to_reference']:.2f}× | {r['py_ratio_to_reference']:.2f}× | {r['reference']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    half = getattr(torch, args.dtype)
    # a Tensor-method wrapper is several µs slower with wrapt's pure-Python fallback
    try:
        from wrapt import _wrappers

        c_ext = wrapt.FunctionWrapper is _wrappers.FunctionWrapper
    except ImportError:
        c_ext = False
    rows = measure(half, args.rounds)
    if args.markdown:
        print(to_markdown(rows, half))
    else:
        print("\n".join(str(r) for r in rows))
    path = "C fast path" if wrappers.fast else f"no C fast path ({wrappers.FAST_UNAVAILABLE})"
    print(f"torch {torch.__version__}, wrapt {wrapt.__version__} ({'C extension' if c_ext else 'pure Python'}), {path}, 1 thread")
    return rows


if __name__ == "__main__":
    main()
