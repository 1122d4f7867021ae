"""Per-call cost of a patched op on tiny tensors (dispatch overhead, not math).

For F.linear, torch.mm and Tensor.__add__ it measures, in one process:
  * the unpatched op,
  * the patched op when nothing needs casting (inputs already in the half dtype),
  * the patched op when it casts (FP32 inputs), next to the same call under
    torch.autocast (where autocast covers the op).

Each figure is the best of several interleaved repeats, so background load on
a shared machine inflates it as little as possible. Run:

    python benchmarks/micro_overhead.py [--dtype bfloat16|float16] [--markdown]
"""
from __future__ import annotations

import argparse
import timeit

import torch
import torch.nn.functional as F

import amp_patch


def best(fn, number=2000, repeat=7):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # µs per call


def measure(half: torch.dtype):
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    w = torch.nn.Parameter(torch.randn(8, 8))
    b = torch.nn.Parameter(torch.randn(8))
    xh, wh, bh = x.to(half), w.detach().to(half), b.detach().to(half)
    ops = {
        "F.linear": (lambda: F.linear(xh, wh, bh), lambda: F.linear(x, w, b)),
        "torch.mm": (lambda: torch.mm(xh, wh), lambda: torch.mm(x, w)),
        "Tensor.__add__": (lambda: xh + wh, lambda: x + wh),
    }
    rows = []
    for name, (nocast, cast) in ops.items():
        base_nocast = best(nocast)
        base_cast = best(cast)
        with torch.autocast("cpu", dtype=half):
            ac_cast = best(cast)
        amp_patch.initialize(None, None, "O1", half_dtype=half, verbosity=0)
        try:
            p_nocast = best(nocast)
            p_cast = best(cast)
        finally:
            amp_patch.deinitialize()
        # autocast does not cover add: its "cast" figure is the native mixed-dtype add
        covered = name != "Tensor.__add__"
        rows.append(
            dict(
                op=name,
                unpatched_us=base_nocast,
                patched_nocast_us=p_nocast,
                overhead_us=p_nocast - base_nocast,
                patched_cast_us=p_cast,
                autocast_cast_us=ac_cast if covered else base_cast,
                ratio_to_autocast=p_cast / (ac_cast if covered else base_cast),
                reference="torch.autocast" if covered else "native mixed-dtype op",
            )
        )
    return rows


def to_markdown(rows, half):
    lines = [
        f"| op ({str(half).split('.')[-1]}) | unpatched µs | patched, no cast µs | overhead µs | patched, casting µs | reference µs | ratio | reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['unpatched_us']:.2f} | {r['patched_nocast_us']:.2f} | {r['overhead_us']:.2f} | "
            f"{r['patched_cast_us']:.2f} | {r['autocast_cast_us']:.2f} | {r['ratio_to_autocast']:.2f}× | {r['reference']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    half = getattr(torch, args.dtype)
    rows = measure(half)
    print(to_markdown(rows, half) if args.markdown else "\n".join(str(r) for r in rows))
    return rows


if __name__ == "__main__":
    main()
