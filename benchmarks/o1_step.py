"""The O1/O4 optimizer step alone: torch's own step against the one-pass C step.

    nice python benchmarks/o1_step.py [--markdown] [--threads N] [--no-assert]

O1 keeps the model's FP32 parameters, so its step is the user's optimizer on
them; where the C extension is built, amp_patch takes it in one call per
param group (``amp_patch/precision/onepass.py``) instead of torch's few tensor
operations per parameter. Two parameter sets:

- ``tiny MLP``: the suite's ``smallops`` model (50 parameters of 64 to 4096
  values), where the calls cost more than the arithmetic;
- ``simplenet``: three 2048x2048 Linear layers (12.6 M values), where memory
  traffic dominates.

Gradients are set once (no forward or backward); ``optimizer.step()`` is
timed for SGD, SGD with momentum 0.9 and AdamW, torch's step (the optimizer
with amp_patch not initialized) and O1's (``initialize(..., "O1")``) in
interleaved blocks on the same tensors, each ratio taken per block and the
median over blocks.

Target ("never slower than FP32", where O1's step is concerned),
asserted unless ``--no-assert``: where O1 takes the one-pass step, at most
torch's time. Plain SGD keeps torch's step at O1 (torch's is one ``add_``
per parameter already; the kernel only matched it here), so its row shows
what O1's patched ``step`` costs around torch's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

import amp_patch
from amp_patch.precision import onepass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import SmallOps  # noqa: E402

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-4),
    "SGD momentum 0.9": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
}
MODELS = {
    "tiny MLP": lambda: SmallOps(),
    "simplenet": lambda: nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(3))),
}


def _block(opt, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def measure(model_name: str, opt_name: str, rounds: int, block_s: float):
    """(torch's step seconds, O1's step seconds, median per-round ratio O1/torch, one-pass steps)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = OPTIMIZERS[opt_name](model.parameters())
    opt.step()  # the optimizer state exists from here on in both modes
    t = _block(opt, 3)
    steps = max(3, round(block_s / t))
    plain, o1, ratios, one_pass = [], [], [], 0
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        this = {}
        for amp_on in order:
            if amp_on:
                amp_patch.initialize(model, opt, "O1", verbosity=0)
            try:
                _block(opt, 2)  # warm
                this[amp_on] = _block(opt, steps)
                if amp_on:
                    one_pass += amp_patch.counters()["optimizers"][0]["one_pass"]
            finally:
                if amp_on:
                    amp_patch.deinitialize()
        plain.append(this[False])
        o1.append(this[True])
        ratios.append(this[True] / this[False])
    return statistics.median(plain), statistics.median(o1), statistics.median(ratios), one_pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--block-seconds", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--no-assert", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    built = onepass.native is not None
    print(f"torch {torch.__version__}, {args.threads} thread(s), one-pass step "
          f"{'built (sqrt: ' + onepass.sqrt_mode() + ')' if built else 'not built: ' + onepass.UNAVAILABLE}")
    rows, missed = [], []
    for model_name in MODELS:
        for opt_name in OPTIMIZERS:
            plain, o1, ratio, one_pass = measure(model_name, opt_name, args.rounds, args.block_seconds)
            rows.append((model_name, opt_name, plain * 1e6, o1 * 1e6, ratio, one_pass > 0))
            if one_pass and not ratio <= 1.0:
                missed.append(f"{model_name} {opt_name}: O1's step {ratio:.2f}x torch's")
    head = ("parameters", "optimizer", "torch's step µs", "O1 step µs", "O1 / torch (median per round)", "one-pass")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for m, o, a, b, r, k in rows:
            print(f"| {m} | {o} | {a:.1f} | {b:.1f} | {r:.2f} | {'yes' if k else 'no'} |")
    else:
        for m, o, a, b, r, k in rows:
            print(f"{m:10s} {o:18s} torch {a:9.1f} µs  O1 {b:9.1f} µs  ratio {r:.2f}  one-pass {'yes' if k else 'no'}")
    if missed and not args.no_assert and built:
        print("Target missed: " + "; ".join(missed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
