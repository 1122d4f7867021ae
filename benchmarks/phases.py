"""Where a step's time goes: forward, backward and optimizer step, timed apart,
for torch.autocast, O2 and O3 (and FP32) on one of the suite's CPU workloads.

    python benchmarks/phases.py                                   # simplenet, BF16
    python benchmarks/phases.py --workloads simplenet transformer --rounds 9

The suite (``suite.py``) times whole steps; this splits them, for finding what
is left around the GEMMs on a CPU whose BF16 matrix units make them fast
(``amx_bf16``). Each round builds every mode afresh in this process and times
a block of steps of each, in an order rotated every round, by the thread's CPU
time; every figure is the median over rounds, and each ratio (to autocast's
phase) is taken within a round, then the median. One thread, as the suite.
Where the CPU has no BF16 instructions, torch emulates BF16 and the GEMMs take
nearly the whole step: the script says so.

``--around-gemms`` adds what such a CPU leaves once its GEMMs are fast, measured
on any CPU: a few more steps of each mode run under ``torch.profiler``, and each
phase's time outside the GEMM ops (``aten::mm``/``addmm``/``bmm``/``baddbmm``, the
convolutions) is printed. These are the parts the GEMM units do not speed up, so
this is where the time on an AMX CPU goes. What it cannot split out: the profiler
adds a few microseconds to every op; memory a step allocates afresh is page-faulted
in inside whichever op first writes it, a GEMM's output included; and attention
kernels count as outside, though a matrix unit speeds up the GEMMs inside them.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import amp_patch  # noqa: E402
from amp_patch.diagnostics.setup_checks import cpu_has_native_bf16  # noqa: E402
from workloads import build  # noqa: E402

PHASES = ("forward", "backward", "step")
MODES = ("fp32", "autocast", "O2", "O3")  # the default; O1 on request (--modes)
LEVELS = ("O1", "O2", "O3")


class Mode:
    """One mode on a fresh copy of the workload, initialized for one block of steps."""

    def __init__(self, name: str, workload: str, scale: float, half: torch.dtype):
        self.name, self.half = name, half
        self.w = build(workload, scale=scale)
        self.model = self.w.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.w.lr, momentum=self.w.momentum)
        if name in LEVELS:
            self.model, self.opt = amp_patch.initialize(self.model, self.opt, name, half_dtype=half, verbosity=0)

    def close(self) -> None:
        if self.name in LEVELS:
            amp_patch.deinitialize()

    def step(self, i: int, phase: Callable[[str], ContextManager[None]]) -> None:
        """Training step ``i``, each phase inside ``phase(name)``."""
        x, y = self.w.batches[i % len(self.w.batches)]
        with phase("forward"):
            if self.name == "autocast":
                with torch.autocast("cpu", dtype=self.half):
                    out = self.model(x)
            else:
                out = self.model(x)
            loss = self.w.loss_fn(out.float(), y)
        with phase("backward"):
            loss.backward()
        with phase("step"):
            self.opt.step()
            self.opt.zero_grad()

    def steps(self, n: int, warm: int = 2) -> Dict[str, float]:
        """Seconds of CPU time per step in each phase, over ``n`` steps after ``warm``."""
        total = dict.fromkeys(PHASES, 0.0)
        clock = time.thread_time
        counting = False

        @contextlib.contextmanager
        def timed(name: str):
            t0 = clock()
            yield
            if counting:
                total[name] += clock() - t0

        for i in range(warm + n):
            counting = i >= warm
            self.step(i, timed)
        return {k: v / n for k, v in total.items()}

    def around_gemms(self, n: int) -> Dict[str, float]:
        """Per phase, seconds per step outside the GEMM ops over ``n`` profiled steps."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(n):
                self.step(i, lambda name: record_function(MARK + name))
        events = prof.events()
        spans = [(e.name[len(MARK):], e.time_range.start, e.time_range.end) for e in events if e.name.startswith(MARK)]
        rest = dict.fromkeys(PHASES, 0.0)
        for name, start, end in spans:
            rest[name] += end - start
        for e in events:
            if e.name in GEMMS:
                for name, start, end in spans:
                    if start <= e.time_range.start and e.time_range.end <= end:
                        rest[name] -= e.self_cpu_time_total
                        break
        return {k: rest[k] / n / 1e6 for k in PHASES}  # the profiler's microseconds


#: the ops a BF16 matrix unit speeds up (their own time: a cast or add inside one is not theirs)
GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn_convolution",
                   "aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution",
                   "aten::mkldnn_linear", "aten::_addmm_activation"})
MARK = "phases::"


def run(workload: str, args: argparse.Namespace) -> None:
    half = getattr(torch, args.dtype)
    modes = tuple(dict.fromkeys(["autocast"] + list(args.modes)))  # every ratio is to autocast's phase
    timed: List[Dict[str, Dict[str, float]]] = []
    around: List[Dict[str, Dict[str, float]]] = []
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        got: Dict[str, Dict[str, float]] = {}
        outside: Dict[str, Dict[str, float]] = {}
        for name in order:
            mode = Mode(name, workload, args.scale, half)
            try:
                got[name] = mode.steps(args.steps)
                if args.around_gemms:  # the same process state as the timed block
                    outside[name] = mode.around_gemms(args.steps)
            finally:
                mode.close()
        timed.append(got)
        around.append(outside)
    print(f"\n{workload} (scale {args.scale}, {args.dtype}, {args.rounds} rounds of {args.steps} steps): "
          f"ms of CPU time per step, median over rounds; (x autocast's phase, median of per-round ratios)")
    _table(timed, modes)
    if args.around_gemms:
        print(f"\n{workload}, outside the GEMMs ({args.steps} profiled steps of each mode after its timed "
              f"block, every round): ms per step, median over rounds; (x autocast's phase, as above)")
        _table(around, modes)


def _table(rounds: List[Dict[str, Dict[str, float]]], modes: Tuple[str, ...]) -> None:
    print(f"| mode | {' | '.join(PHASES)} | whole step |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name in modes:
        cells = []
        for k in PHASES + ("whole",):
            def val(rd: Dict[str, Dict[str, float]], m: str) -> float:
                return sum(rd[m].values()) if k == "whole" else rd[m][k]
            ms = statistics.median(val(rd, name) for rd in rounds) * 1e3
            ratio = statistics.median(val(rd, name) / val(rd, "autocast") for rd in rounds if val(rd, "autocast") > 0)
            cells.append(f"{ms:.2f} ({ratio:.2f}x)")
        print(f"| {name} | {' | '.join(cells)} |")


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["simplenet"], choices=["simplenet", "transformer", "convnet", "smallops"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode per round")
    p.add_argument("--scale", type=float, default=1.0, help="shrink or grow the workload, as suite.py's --scale")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=["fp32", "autocast", *LEVELS],
                   help="what to time (autocast always: the ratios are to it)")
    p.add_argument("--around-gemms", action="store_true",
                   help="also profile each phase's time outside the GEMMs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cpu = "native BF16 instructions" if cpu_has_native_bf16() else \
        "no BF16 instructions: torch emulates BF16 here, so the GEMMs take nearly all of forward and backward"
    print(f"torch {torch.__version__}, 1 thread; this CPU: {cpu}")
    for w in args.workloads:
        run(w, args)


if __name__ == "__main__":
    main()
