"""What unscaling at the end of every backward costs.

Every scaled backward ends with its gradients unscaled and checked (true
gradients whenever user code can see them). This compares, in one run and in
interleaved rounds, a training step whose backward unscales as it ends with
the same step written ``scale_loss(..., delay_unscale=True)`` for every
backward, which leaves the gradients scaled for the step to unscale once (the
deferred scheme): one backward per step, and gradient accumulation over 4
micro-batches, where the deferred scheme unscales once per step and the eager
one 4 times (plus the parking of the running sum). FP16 with a dynamic loss scale; O1 and O2.

    python benchmarks/unscale_cost.py [--rounds 7] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import amp_patch  # noqa: E402
from workloads import build  # noqa: E402


def step_fn(wl, model, opt, micro, eager):
    batches = wl.batches

    def step():
        opt.zero_grad()
        for k in range(micro):
            x, y = batches[k % len(batches)]
            loss = wl.loss_fn(model(x), y)
            with amp_patch.scale_loss(loss, opt, delay_unscale=not eager) as s:
                s.backward()
        opt.step()

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed block")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), FP16 dynamic loss scale; ratio = eager / deferred "
          f"(median over {args.rounds} interleaved rounds, IQR)")
    print("| workload | level | micro-batches | deferred ms/step | eager ms/step | eager / deferred |")
    print("|---|---|---|---|---|---|")
    for name, scale in (("simplenet", 0.25), ("transformer", 0.125)):
        for level in ("O1", "O2"):
            for micro in (1, 4):
                wl = build(name, scale=scale)
                model = wl.model
                opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
                model, opt = amp_patch.initialize(model, opt, level, half_dtype=torch.float16, verbosity=0)
                try:
                    fns = {e: step_fn(wl, model, opt, micro, e) for e in (False, True)}
                    for f in fns.values():
                        f()  # warm-up
                    times = {False: [], True: []}
                    for r in range(args.rounds):
                        for e in ((False, True) if r % 2 else (True, False)):
                            t0 = time.process_time() if args.threads == 1 else time.perf_counter()
                            for _ in range(args.steps):
                                fns[e]()
                            t1 = time.process_time() if args.threads == 1 else time.perf_counter()
                            times[e].append((t1 - t0) / args.steps)
                    ratios = [a / b for a, b in zip(times[True], times[False])]
                    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                    print(f"| {name} | {level} | {micro} | {statistics.median(times[False]) * 1e3:.1f} | "
                          f"{statistics.median(times[True]) * 1e3:.1f} | {statistics.median(ratios):.3f} "
                          f"({q[0]:.3f}–{q[2]:.3f}) |", flush=True)
                finally:
                    amp_patch.deinitialize()


if __name__ == "__main__":
    main()
