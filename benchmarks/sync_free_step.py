"""What sync-free steps cost or save per step: ``sync_free=True`` (the default)
against ``sync_free=False`` (the skip decision read on the host, one sync a
step), in paired rounds of one process, and the host reads each makes.

    python benchmarks/sync_free_step.py                       # CPU, FP16, O1 and O2
    python benchmarks/sync_free_step.py --device cuda --fused  # a GPU; torch's fused SGD

On a CPU a host read costs next to nothing, so this measures what keeping the
scale on the device adds (a few 0-d tensor ops a step); on a GPU the sync is
what it saves. Prints the median ratio of step times (sync-free / synced) with
its spread over rounds, and the host reads per step counted by patching
``Tensor.item``/``tolist``/``__bool__``/``__float__``/``__int__``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import amp_patch

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Mode:
    """One configuration, initialized for a block of steps and torn down after it."""

    def __init__(self, level: str, sync_free: bool, args: argparse.Namespace):
        self.level, self.sync_free, self.args = level, sync_free, args
        self.model = _model(args.width, args.depth).to(args.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9,
                                   fused=True if args.fused else None)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch, args.width, generator=g).to(args.device)
        self.y = torch.randint(0, 10, (args.batch,), generator=g).to(args.device)

    def block(self, steps: int) -> float:
        half = getattr(torch, self.args.dtype)
        model, opt = amp_patch.initialize(self.model, self.opt, self.level, half_dtype=half, verbosity=0,
                                          sync_free=self.sync_free)
        try:
            self._steps(model, opt, 2)  # the first step makes the optimizer state
            self._sync()
            t = time.perf_counter()
            self._steps(model, opt, steps)
            self._sync()
            return (time.perf_counter() - t) / steps
        finally:
            amp_patch.deinitialize()

    def reads_per_step(self, steps: int = 5) -> float:
        half = getattr(torch, self.args.dtype)
        model, opt = amp_patch.initialize(self.model, self.opt, self.level, half_dtype=half, verbosity=0,
                                          sync_free=self.sync_free)
        count = [0]
        saved = {n: getattr(torch.Tensor, n) for n in READS}
        own = {n: vars(torch.Tensor).get(n) for n in READS}
        try:
            self._steps(model, opt, 2)
            for n in READS:
                def read(t, *a, _real=saved[n], **k):
                    count[0] += 1
                    return _real(t, *a, **k)
                setattr(torch.Tensor, n, read)
            self._steps(model, opt, steps)
        finally:
            for n in READS:
                if own[n] is None:
                    delattr(torch.Tensor, n)
                else:
                    setattr(torch.Tensor, n, own[n])
            amp_patch.deinitialize()
        return count[0] / steps

    def _steps(self, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            F.cross_entropy(model(self.x).float(), self.y).backward()
            opt.step()
            opt.zero_grad()

    def _sync(self) -> None:
        if self.args.device == "cuda":
            torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"],
                    help="float16 (the default): the dtype loss scaling works for")
    ap.add_argument("--levels", nargs="+", default=["O1", "O2"])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fused", action="store_true", help="torch's SGD(fused=True): the sync-free step on CUDA")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device {args.device}, {args.dtype}, MLP width {args.width} depth {args.depth}, batch {args.batch}, "
          f"SGD{'(fused)' if args.fused else ''}, {args.rounds} rounds of {args.steps} steps, torch {torch.__version__}")
    print("| level | sync-free / synced step time (median, spread) | host reads a step: sync-free | synced |")
    print("|---|---|---|---|")
    for level in args.levels:
        free, synced = Mode(level, True, args), Mode(level, False, args)
        ratios: List[float] = []
        for r in range(args.rounds):
            pair: Dict[bool, float] = {}
            for m in ((free, synced) if r % 2 == 0 else (synced, free)):  # alternate who goes first
                pair[m.sync_free] = m.block(args.steps)
            ratios.append(pair[True] / pair[False])
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"| {level} | {statistics.median(ratios):.3f}x ({q[0]:.3f}-{q[2]:.3f}) | "
              f"{free.reads_per_step():g} | {synced.reads_per_step():g} |")


if __name__ == "__main__":
    main()
