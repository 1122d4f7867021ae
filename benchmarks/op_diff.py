"""What one mode's training step runs that another's does not: a profiler diff.

    python benchmarks/op_diff.py                                   # gpt at the CPU size: autocast against O1, BF16
    python benchmarks/op_diff.py --workload transformer --modes autocast O2
    python benchmarks/op_diff.py --device cuda --workload gpt      # the GPU size, FP16, with its CUDA kernels

Each mode trains a fresh copy of the workload through the suite's ``Runner``
(``benchmarks/workloads.py``: the same step, ``GradScaler`` included for
autocast in FP16) for ``--warmup`` steps, then one more step under a dispatch
mode that counts each aten op's calls and the bytes of the tensors it reads and
writes, then ``--steps`` steps under ``torch.profiler`` for the time. Per
training step and op, the table gives both modes' calls, time (self CPU time on
a CPU; on a GPU the time of the kernels the op launched) and megabytes read and
written, sorted by the difference in time; ops that differ in nothing are left
out. On a GPU a second table does the same for the CUDA kernels themselves.
The totals say how many more ops (or kernel launches), how much more time and
how much more memory traffic the second mode makes: a per-op Python cost shows
as time without ops or bytes, an extra cast or copy as ops and bytes.

The bytes are the sizes of the op's tensor arguments and results, an upper bound
of what its kernels move (a view moves nothing and counts nothing).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
import amp_patch  # noqa: E402
from workloads import AMP_MODES, Runner, build  # noqa: E402

#: ops that move no memory of their own (views, metadata)
_VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "detach",
                    "alias", "reshape", "unsqueeze", "squeeze", "select", "slice", "split", "unbind",
                    "_reshape_alias", "view_as", "split_with_sizes", "unflatten", "narrow", "diagonal",
                    "lift_fresh"})


class Stats:
    """Per op: calls, seconds and bytes, each per training step."""

    def __init__(self) -> None:
        self.calls: Dict[str, float] = collections.Counter()
        self.seconds: Dict[str, float] = collections.Counter()
        self.bytes: Dict[str, float] = collections.Counter()


class _Count(TorchDispatchMode):
    """Counts the bytes of each aten op's tensor arguments and results."""

    def __init__(self, into: Stats):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = "aten::" + func.overloadpacket.__name__
        if func.overloadpacket.__name__ not in _VIEWS:
            seen = set()
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.into.bytes[name] += t.numel() * t.element_size()
        return out


def measure(workload: str, mode: str, device: str, half: torch.dtype, scale: float,
            warmup: int, steps: int) -> Tuple[Stats, Optional[Stats]]:
    """One mode's per-step op statistics, and on a GPU its kernels'."""
    wl = build(workload, gpu=device == "cuda", scale=scale, nbatches=2)
    runner = Runner(wl, mode, device, half, copy_model=False)
    try:
        for _ in range(warmup):
            runner.step()
        ops = Stats()
        with _Count(ops):
            runner.step()
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.step()
            _sync(device)
        kernels = Stats() if device == "cuda" else None
        for e in prof.key_averages():  # calls as the profiler counts them: the ops an op calls inside too
            if e.key.startswith("aten::"):
                us = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
                ops.seconds[e.key] += us / 1e6 / steps
                ops.calls[e.key] += e.count / steps
        if kernels is not None:
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    kernels.calls[e.name] += 1 / steps
                    kernels.seconds[e.name] += e.time_range.elapsed_us() / 1e6 / steps
        ops.seconds["(whole step)"] = _step_seconds(prof, device) / steps
        return ops, kernels
    finally:
        if mode in AMP_MODES:
            amp_patch.deinitialize()


def _step_seconds(prof: Any, device: str) -> float:
    """The profiled steps' span: the CPU's from first to last op; on a GPU the device's."""
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA) == (device == "cuda")]
    if not events:
        return 0.0
    return (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e6


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def table(a: Stats, b: Stats, names: Tuple[str, str], what: str, rows: int) -> List[str]:
    """Markdown rows: each op the two modes call a different number of times or with other
    tensors (the time alone differs between any two runs), largest time difference first."""
    keys = set(a.calls) | set(b.calls) | set(a.seconds) | set(b.seconds)
    keys.discard("(whole step)")
    differ = [k for k in keys if round(a.calls[k], 3) != round(b.calls[k], 3) or a.bytes[k] != b.bytes[k]]
    differ.sort(key=lambda k: -abs(b.seconds[k] - a.seconds[k]))
    x, y = names
    out = [f"| {what} | calls {x} | calls {y} | ms {x} | ms {y} | MB {x} | MB {y} |", "|---|---|---|---|---|---|---|"]
    for k in differ[:rows]:
        out.append(f"| `{k}` | {a.calls[k]:g} | {b.calls[k]:g} | {a.seconds[k] * 1e3:.3f} | {b.seconds[k] * 1e3:.3f} "
                   f"| {a.bytes[k] / 1e6:.2f} | {b.bytes[k] / 1e6:.2f} |")
    if len(differ) > rows:
        out.append(f"| ({len(differ) - rows} more) | | | | | | |")
    ta, tb = (sum(v for k, v in s.seconds.items() if k != "(whole step)") for s in (a, b))
    out.append(f"| **all {what}s** | {sum(a.calls.values()):g} | {sum(b.calls.values()):g} | {ta * 1e3:.3f} "
               f"| {tb * 1e3:.3f} | {sum(a.bytes.values()) / 1e6:.2f} | {sum(b.bytes.values()) / 1e6:.2f} |")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpt", choices=["simplenet", "transformer", "convnet", "smallops", "gpt", "resnet"])
    p.add_argument("--modes", nargs=2, default=["autocast", "O1"], metavar=("A", "B"),
                   help="the two modes to compare (benchmarks/workloads.py's MODES)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"], help="default: BF16 on CPU, FP16 on CUDA")
    p.add_argument("--scale", type=float, default=0.5, help="the CPU sizes' scale (suite.py's --scale)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per mode")
    p.add_argument("--rows", type=int, default=25, help="ops shown per table")
    args = p.parse_args(argv)
    half = getattr(torch, args.dtype) if args.dtype else (torch.float16 if args.device == "cuda" else torch.bfloat16)
    if args.device == "cpu":
        torch.set_num_threads(1)
    names = (args.modes[0], args.modes[1])
    got = [measure(args.workload, m, args.device, half, args.scale, args.warmup, args.steps) for m in names]
    (a, ka), (b, kb) = got
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, 1 thread"
    print(f"{args.workload} on {where}, {str(half)[6:]}, torch {torch.__version__}: per training step, "
          f"{args.steps} profiled after {args.warmup} warm-up; ops where {names[0]} and {names[1]} differ")
    print(f"whole step: {a.seconds['(whole step)'] * 1e3:.2f} ms {names[0]}, {b.seconds['(whole step)'] * 1e3:.2f} ms "
          f"{names[1]} (profiled: the profiler's cost is in both)\n")
    print("\n".join(table(a, b, names, "aten op", args.rows)))
    if ka is not None and kb is not None:
        print()
        print("\n".join(table(ka, kb, names, "kernel", args.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
