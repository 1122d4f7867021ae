"""Cost of finding the leaves a scaled backward reaches (``amp_patch/leaves.py``).

Under FP16 loss scaling every plain ``loss.backward()`` walks the autograd
graph once, to find leaves no attached optimizer owns. This script times, on
the benchmark workloads at O1-FP16, the walk alone and a whole backward with
the walk against the same backward with the walk skipped, interleaved in one
run, and prints the ratio.

    python benchmarks/backward_walk.py                 # simplenet, transformer, smallops at scale 0.25
    python benchmarks/backward_walk.py --workloads transformer --reps 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import amp_patch  # noqa: E402
from amp_patch.scaling import patches  # noqa: E402
from amp_patch.scaling import leaves
from workloads import build  # noqa: E402


def _no_walk(run, loss, handles, loss_id, scale):
    return True, []


def measure(name: str, reps: int, scale: float) -> dict:
    wl = build(name, scale=scale)
    model, opt = wl.model, torch.optim.SGD(wl.model.parameters(), lr=wl.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, loss_scale=128.0, verbosity=0)
    x, y = wl.batches[0]
    walk_s, with_s, without_s = [], [], []
    real = patches.guard_foreign
    try:
        for i in range(reps * 2):
            loss = wl.loss_fn(model(x), y)
            t = time.perf_counter()
            n = len(leaves.graph_leaves(loss))
            walk_s.append(time.perf_counter() - t)
            skip = i % 2 == 1
            patches.guard_foreign = _no_walk if skip else real
            t = time.perf_counter()
            loss.backward()
            (without_s if skip else with_s).append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
            patches.guard_foreign = real
    finally:
        patches.guard_foreign = real
        amp_patch.deinitialize()
    med = statistics.median
    return dict(name=name, leaves=n, walk_us=med(walk_s) * 1e6, with_ms=med(with_s) * 1e3,
                without_ms=med(without_s) * 1e3, ratio=med(with_s) / med(without_s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # convnet is left out by default: FP16 convolutions on a CPU take seconds per backward
    ap.add_argument("--workloads", nargs="+", default=["simplenet", "transformer", "smallops"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| workload | leaves | walk (µs) | backward with walk (ms) | without (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        r = measure(name, args.reps, args.scale)
        print(f"| {r['name']} | {r['leaves']} | {r['walk_us']:.0f} | {r['with_ms']:.2f} | {r['without_ms']:.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
