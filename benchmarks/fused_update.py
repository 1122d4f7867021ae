"""The O2 optimizer step alone: plain (three passes) against ``fused_update=True``.

    python benchmarks/fused_update.py [--markdown]

Workload 1's parameters (three 2048x2048 Linear layers) at O2 (BF16 by
default; ``--dtype float16`` adds the loss scale's check and unscale), their half
gradients made by a cheap backward (``sum(p * g)``), then ``optimizer.step()`` timed with no forward or
backward around it: the plain O2 step (copy the gradients into FP32, the
optimizer's own update, copy the masters into the model) against the fused
update, for SGD, SGD with momentum and AdamW. One thread; the two run in
alternating blocks and the ratio is taken per block (median over blocks).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import amp_patch

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-4),
    "SGD momentum 0.9": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
}


class Stepper:
    """One O2 model and optimizer; ``step()`` times one optimizer step."""

    def __init__(self, name: str, fused: bool, width: int, half: torch.dtype):
        torch.manual_seed(0)
        self.model = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
        opt = OPTIMIZERS[name](self.model.parameters())
        self.half = half
        self.model, self.opt = amp_patch.initialize(self.model, opt, "O2", half_dtype=half, fused_update=fused,
                                                    verbosity=0)
        g = torch.Generator().manual_seed(1)
        self.grads = [torch.randn(p.shape, generator=g).to(p.dtype) * 1e-3 for p in self.model.parameters()]
        for _ in range(3):  # optimizer state, then the compile
            self.step()

    def step(self) -> float:
        self.opt.zero_grad()
        # a backward whose gradients are self.grads, without the GEMMs
        sum((p * g).sum() for p, g in zip(self.model.parameters(), self.grads)).backward()
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t


def measure(name: str, width: int, blocks: int, reps: int, half: torch.dtype) -> dict:
    out = {}
    for fused in (False, True):  # amp_patch's state is per process: one at a time
        s = Stepper(name, fused, width, half)
        out[fused] = s
        amp_patch.deinitialize()
    times = {False: [], True: []}
    for b in range(blocks):
        for fused in ((False, True) if b % 2 == 0 else (True, False)):
            s = out[fused]
            amp_patch.initialize(s.model, s.opt, "O2", half_dtype=half, fused_update=fused, verbosity=0)
            times[fused].append(statistics.median(s.step() for _ in range(reps)))
            amp_patch.deinitialize()
    ratio = statistics.median(f / p for p, f in zip(times[False], times[True]))
    return {"plain_ms": statistics.median(times[False]) * 1e3, "fused_ms": statistics.median(times[True]) * 1e3,
            "ratio": ratio}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="float16 adds the dynamic loss scale: the inf/NaN check and the unscale")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    half = getattr(torch, args.dtype)
    rows = [(name, measure(name, args.width, args.blocks, args.reps, half)) for name in OPTIMIZERS]
    n = 3 * (args.width * args.width + args.width)
    print(f"O2 {args.dtype} optimizer step, {n / 1e6:.1f} M parameters, 1 thread, torch {torch.__version__}")
    if args.markdown:
        print("\n| optimizer | plain O2 step ms | fused step ms | fused / plain |\n|---|---|---|---|")
        for name, r in rows:
            print(f"| {name} | {r['plain_ms']:.1f} | {r['fused_ms']:.1f} | {r['ratio']:.2f} |")
    else:
        for name, r in rows:
            print(f"{name:18s} plain {r['plain_ms']:7.1f} ms  fused {r['fused_ms']:7.1f} ms  ratio {r['ratio']:.2f}")
    return rows


if __name__ == "__main__":
    main()
