"""``amp-patch demo``: the Paddle AMP tutorial's benchmark, with amp_patch.

Trains the tutorial's SimpleNet (three ``Linear`` layers, ReLU after the
first two, MSE loss) in FP32, then under O1 and O2, on the best device there
is (CUDA with FP16, else the CPU with BF16), and prints the tutorial's
comparison: time per step, speedup over FP32, the loss at the first and the
last step, peak memory, and the dtypes the layers ran in. The tutorial fits
random targets with SGD at lr 1e-4, where the loss never moves; here the
targets are a fixed linear map of the inputs and the optimizer is Adam, so
the loss column shows each mode learning the same thing.

It measures as ``benchmarks/suite.py`` does, so that its figures hold from run
to run: each mode trains in a worker process of its own (amp_patch's state is
per process), untimed warm-up steps first; then the modes run in rounds, each
round one block of the same number of steps per mode, in an order rotated
every round; a mode's speedup is taken against the FP32 block of the same
round, and each figure is the median over rounds with its spread (half the
interquartile range, over the median). On a CPU every worker runs one thread
by default and a step's time is the worker's CPU time, which time the core
spends on other work does not count. The demo says when the figures cannot be
trusted: a speedup whose spread over rounds is above ``NOISY_SPREAD`` (a
speedup is a ratio of two blocks of the same round, so other work that slows
every mode alike cancels out of it; the load average is reported, not judged).

The default sizes take well under a minute on two CPU cores; ``--full`` runs
the tutorial's own sizes and step count (4096 wide, batch 512, 50 batches,
250 steps per mode), says up front about how long that will take (from one
matmul of its size timed before anything else starts), again once the warm-up
has measured each mode, and its progress round by round.
"""
from __future__ import annotations

__amp_patch_frame__ = "user"  # frames.py: its training loop runs as a user's would

import argparse
import dataclasses
import gc
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import frontend
from ..diagnostics import AmpWarning, setup_checks
from ..diagnostics.stats import dtype_name
from ..base.errors import ConfigError
from ..scaling.checkpoint import counters
from ..precision import onepass
from .compare import SuggestingParser

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import BaseContext
    from multiprocessing.process import BaseProcess

MODES = ("FP32", "O1", "O2")
NO_NATIVE_BF16 = (
    "This CPU has no BF16 instructions (AVX512_BF16, AMX or Arm BF16), so torch emulates BF16 math "
    "on it, far slower than FP32."
)
#: the tutorial's sizes and step count (5 epochs of 50 batches), in 10 rounds of 25 steps
FULL = dict(size=4096, batch_size=512, batches=50, steps=250, rounds=10)
#: the default sizes: a GPU needs the tutorial's to show a speedup (at the CPU's,
#: a step takes a millisecond or two, which the per-op overheads dominate)
SIZES = {"cpu": dict(size=1024, batch_size=256), "cuda": dict(size=4096, batch_size=512)}
#: the default rounds and timed steps per mode: a fixed count, so the loss column is the same in every run
ROUNDS = 7
STEPS = 42
#: a speedup whose spread over rounds (half its IQR, over its median) is above this is noise
NOISY_SPREAD = 0.10
#: matmuls of one training step of SimpleNet: 3 forward, 3 weight gradients, 2 input gradients
MATMULS_PER_STEP = 8


class SimpleNet(nn.Module):
    """Three Linear layers, ReLU after the first two (the tutorial's network)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.linear1 = nn.Linear(input_size, output_size)
        self.relu1 = nn.ReLU()
        self.linear2 = nn.Linear(input_size, output_size)
        self.relu2 = nn.ReLU()
        self.linear3 = nn.Linear(input_size, output_size)

    def forward(self, x):
        x = self.linear1(x)
        x = self.relu1(x)
        x = self.linear2(x)
        x = self.relu2(x)
        return self.linear3(x)


@dataclasses.dataclass
class Result:
    """One row of the table; ``unavailable`` says why a mode did not run.

    ``ms_per_step`` and ``speedup`` (FP32's step time over this mode's, in the
    same round) are medians over rounds; ``*_spread`` their spreads.
    """

    mode: str
    ms_per_step: float = 0.0
    ms_spread: float = 0.0
    speedup: Optional[float] = None
    speedup_spread: float = 0.0
    first_loss: float = 0.0
    final_loss: float = 0.0
    peak_bytes: Optional[int] = None
    layers: str = ""
    unavailable: str = ""
    step: str = ""  # O1/O2/O4/O5: which optimizer step ran


# ------------------------------------------------------------------ statistics


def spread(values: Sequence[float]) -> float:
    """Half the interquartile range of ``values``, over their median (0.05: ±5%).

    Example::

        spread([1.0, 1.0, 1.1, 0.9])   # 0.075
    """
    if len(values) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2 / med if med else math.inf


def round_speedups(times: Dict[str, Sequence[float]]) -> Dict[str, List[float]]:
    """Each mode's speedup over FP32 in every round: FP32's step time over the
    mode's, both from the same round (empty without FP32).

    Example::

        round_speedups({"FP32": [2.0, 3.0], "O1": [1.0, 1.5]})   # {"O1": [2.0, 2.0]}
    """
    fp32 = times.get("FP32")
    if not fp32:
        return {}
    return {m: [f / t for f, t in zip(fp32, ts)] for m, ts in times.items() if m != "FP32" and ts}


def noise_verdict(times: Dict[str, Sequence[float]], threshold: float = NOISY_SPREAD) -> List[str]:
    """Why the figures are too noisy to mean much; empty when they hold.

    Judged on the speedups (``round_speedups``), never on the step times: a
    machine shared with other work moves every mode's time from round to
    round, but the two blocks of a round see the same machine, so their ratio
    holds while the times swing. A speedup whose spread over the rounds
    (``spread``: half its interquartile range, over its median) is above
    ``threshold`` is noise.

    Args:
        times: each mode's step time in every round, FP32's among them.
        threshold: the largest spread a speedup may have (default ``NOISY_SPREAD``, ±10%).

    Example::

        noise_verdict({"FP32": [2.0, 3.0, 2.4, 2.1], "O1": [1.0, 1.5, 1.2, 1.05]})   # [] (2.00x every round)
    """
    reasons = []
    for mode, values in round_speedups(times).items():
        s = spread(values)
        if s > threshold:
            reasons.append(f"{mode}'s speedup varies ±{s:.0%} over {len(values)} rounds (more than ±{threshold:.0%})")
    return reasons


def memory_note(results: Sequence["Result"]) -> Optional[str]:
    """Why O2's peak memory is above FP32's, where it is; None where it is not."""
    peaks = {r.mode: r.peak_bytes for r in results if not r.unavailable and r.peak_bytes}
    if "FP32" not in peaks or "O2" not in peaks or peaks["O2"] <= peaks["FP32"]:
        return None
    return (f"O2's peak memory ({_mib(peaks['O2'])}) is above FP32's ({_mib(peaks['FP32'])}) here: on a model this "
            "small its FP32 master weights, the half copy of the weights and Adam's state outweigh what half "
            "activations save; O2 saves memory where activations dominate (larger batches, longer sequences, "
            "deeper networks).")


# ------------------------------------------------------------------ hardware


def cpu_flags(cpuinfo: Optional[str] = None) -> Optional[Set[str]]:
    """The CPU's instruction-set flags as ``/proc/cpuinfo`` lists them (x86's
    ``flags``, Arm's ``Features``), or None where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags: Set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_bf16_flags(cpuinfo: Optional[str] = None) -> Optional[List[str]]:
    """The BF16 flags of this CPU (``amx_bf16``, ``avx512_bf16``, Arm's ``bf16``)
    as ``/proc/cpuinfo`` lists them, or None where it cannot be read."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    return [f for f in ("amx_bf16", "avx512_bf16", "bf16") if f in flags]


def cpu_name(cpuinfo: Optional[str] = None) -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or the platform's word for it."""
    try:
        if cpuinfo is None:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: torch.device, cpuinfo: Optional[str] = None) -> str:
    """One line on what this machine gives half precision: the GPU and its
    Tensor Cores, or the CPU and its BF16 matrix units (``/proc/cpuinfo`` flags).

    Example::

        hardware(torch.device("cpu"))   # "AMD EPYC, 2 cores; BF16: avx512_bf16 (no amx_bf16): ..."
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        cores = "FP16 Tensor Cores" if major >= 7 else "no Tensor Cores (FP16 runs, but not much faster than FP32)"
        return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}): {cores}"
    name = f"{cpu_name(cpuinfo)}, {os.cpu_count()} cores"
    flags = cpu_bf16_flags(cpuinfo)
    if flags is None:  # no /proc/cpuinfo: ask torch
        native = setup_checks.cpu_has_native_bf16()
        return f"{name}; BF16 instructions: {'yes' if native else 'none'} (as torch reports them)"
    if "amx_bf16" in flags:
        return f"{name}; BF16 matrix units: amx_bf16 (AMX tiles): the fastest BF16 matmuls a CPU has"
    if "avx512_bf16" in flags:
        return f"{name}; BF16: avx512_bf16, no amx_bf16: native BF16 dot products in vector registers, no matrix units"
    if "bf16" in flags:
        return f"{name}; BF16: Arm bf16 instructions"
    return f"{name}; BF16: none of amx_bf16, avx512_bf16: torch emulates BF16 here, slower than FP32"


# ------------------------------------------------------------------ memory


def _storages(tensors) -> Dict[int, int]:
    """``{storage data_ptr: nbytes}`` of the given tensors, each storage once."""
    out: Dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


class _LiveTensors(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, while it is active.

    Starts from the storages it is given (model, optimizer, batch) and adds
    every storage an op creates, until the last tensor on it is freed. This
    is the CPU's answer to CUDA's ``max_memory_allocated``: what the tensors
    need, without the allocator's caching.
    """

    def __init__(self, base: Dict[int, int]):
        super().__init__()
        self.known = set(base)
        self.live: Dict[int, List[int]] = {}  # data_ptr -> [nbytes, tensors alive]
        self.current = self.peak = sum(base.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if not n or ptr in self.known:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [n, 0]
            self.current += n
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[ptr]
                self.current -= entry[0]


def _peak_memory(step, model: nn.Module, optimizer, batch, device: torch.device) -> int:
    """Peak tensor memory of one more training step ``step()``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    state = [v for s in optimizer.state.values() for v in s.values()]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in [*params, *model.parameters()] if p.grad is not None]
    base = _storages([*model.parameters(), *model.buffers(), *params, *grads, *state, *batch])
    gc.collect()
    with _LiveTensors(base) as live:
        step()
        gc.collect()
    return live.peak



# ------------------------------------------------------------------ runs


def _layer_dtypes(model: nn.Module, x: torch.Tensor, label: torch.Tensor, loss_fn) -> str:
    """What each layer's output (and the loss) came out as, e.g. ``linear x3 bfloat16``."""
    seen: List[Tuple[str, torch.dtype]] = []
    handles = [
        m.register_forward_hook(lambda m, a, out, name=name: seen.append((name, out.dtype)))
        for name, m in model.named_children()
    ]
    try:
        with torch.no_grad():
            loss = loss_fn(model(x), label)
    finally:
        for h in handles:
            h.remove()
    seen.append(("loss", loss.dtype))
    groups: Dict[Tuple[str, torch.dtype], int] = {}
    for name, dtype in seen:
        key = (name.rstrip("0123456789"), dtype)
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(
        f"{kind}{f' x{n}' if n > 1 else ''} {dtype_name(dt)}" for (kind, dt), n in groups.items()
    )



# ------------------------------------------------------------------ the workers


#: the optimizer's learning rate (Adam)
LR = 1e-3


def make_data(size: int, batch_size: int, batches: int, seed: int, device: torch.device) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Random inputs and their targets under one fixed random linear map, which
    the network can learn (the tutorial's random targets cannot be)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(size, size, generator=g) / size ** 0.5
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, size, generator=g)
        data.append((x.to(device), (x @ teacher).to(device)))
    return data


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One mode's training: a fresh SimpleNet, Adam, the tutorial's loop.

    Raises ``ConfigError`` when the mode cannot run here (the message says why).
    """

    def __init__(self, mode: str, config: Dict[str, Any], device: torch.device):
        self.mode, self.device = mode, device
        self.warmup = config["warmup"]
        self.data = make_data(config["size"], config["batch_size"], config["batches"], config["seed"], device)
        torch.manual_seed(config["seed"])
        self.model = SimpleNet(config["size"], config["size"]).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.loss_fn = nn.MSELoss()
        self.i = 0
        self.loss: Optional[torch.Tensor] = None
        if mode != "FP32":
            self.model, self.optimizer = frontend.initialize(self.model, self.optimizer, opt_level=mode)

    def step(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.model(x), label)  # the tutorial's loop, unchanged
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def run(self, n: int) -> None:
        """``n`` more steps, through the batches in order."""
        for _ in range(n):
            self.loss = self.step(*self.data[self.i % len(self.data)])
            self.i += 1

    def finish(self) -> Dict[str, Any]:
        """The final loss, the layers' dtypes and the peak memory of one more step."""
        out = {
            "final_loss": float(self.loss.detach()),
            "layers": _layer_dtypes(self.model, *self.data[0], self.loss_fn),
            "peak_bytes": _peak_memory(lambda: self.step(*self.data[0]), self.model, self.optimizer, self.data[0], self.device),
            "step": _step_kind(self.mode, self.warmup, self.i - self.warmup),
        }
        if self.mode != "FP32":
            frontend.deinitialize()
        return out


def step_counts(warmup: int, timed: int) -> str:
    """The steps one mode trains, by what each is for, as the demo labels them everywhere."""
    return f"{warmup} warm-up + {timed} timed + 1 measuring peak memory"


def _step_kind(mode: str, warmup: int, timed: int) -> str:
    """Which optimizer step an O1/O2/O4/O5 run took: the default one-pass step, or the plain one.
    ``warmup`` and ``timed``: the steps it trained before the one that measures peak memory."""
    if mode not in ("O1", "O2", "O4", "O5"):
        return ""
    c = counters()
    one, total = c["optimizers"][0]["one_pass"], c["steps"]
    if one:
        counted = f" ({step_counts(warmup, timed)})" if total == warmup + timed + 1 else ""
        return (f"{mode}'s optimizer step (the default, no option): one pass in C per parameter for {one} of "
                f"its {total} steps{counted}")
    if onepass.native is None:
        return f"{mode}'s optimizer step: the plain step (the one-pass C step is not built here)"
    return f"{mode}'s optimizer step: the plain step (this optimizer is not one the one-pass step covers)"


def _worker(conn: "Connection", mode: str, config: Dict[str, Any], device_name: str, threads: int, quiet_bf16: bool) -> None:
    """One mode in a process of its own: warm up, then run the blocks it is sent."""
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    # One thread: the process's CPU time is the step time without the time
    # other work on the machine held the core. Several threads, or a GPU: wall clock.
    clock = time.process_time if threads == 1 and device.type == "cpu" else time.perf_counter
    with warnings.catch_warnings():
        if quiet_bf16:  # said once by the demo, not once per mode
            warnings.filterwarnings("ignore", message=".*without native BF16", category=AmpWarning)
        try:
            trainer = Trainer(mode, config, device)
        except ConfigError as e:
            conn.send(("unavailable", str(e)))
            conn.close()
            return
        warm = []
        for i in range(config["warmup"]):
            _sync(device)
            t0 = time.perf_counter()
            trainer.run(1)
            _sync(device)
            warm.append(time.perf_counter() - t0)
            if i == 0:
                first_loss = float(trainer.loss.detach())
        conn.send(("ready", min(warm), first_loss))
        while True:
            cmd, n = conn.recv()
            if cmd == "run":
                _sync(device)
                t0 = clock()
                trainer.run(n)
                _sync(device)
                conn.send((clock() - t0) / n)
            else:
                conn.send(trainer.finish())
                conn.close()
                return


def _context(device: torch.device) -> "BaseContext":
    # fork starts a worker without importing torch again (seconds on a small
    # machine); CUDA cannot be forked, and some platforms have no fork
    if device.type == "cpu" and "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    return mp.get_context("spawn")


def _config(args: argparse.Namespace) -> Dict[str, Any]:
    return dict(size=args.size, batch_size=args.batch_size, batches=args.batches, seed=args.seed, warmup=args.warmup)


def measure(modes: Sequence[str], args: argparse.Namespace, device: torch.device,
            quiet_bf16: bool = False) -> Tuple[List[Result], Dict[str, List[float]]]:
    """Train every mode in its own worker, in interleaved rounds.

    Every mode runs the same steps on the same batches: ``args.warmup``
    untimed, then ``args.steps`` in ``args.rounds`` blocks.

    Returns:
        one ``Result`` per mode, and each mode's step time in every round
        (``noise_verdict`` and ``round_speedups`` read them).
    """
    ctx = _context(device)
    config = _config(args)
    workers: Dict[str, Tuple["Connection", "BaseProcess"]] = {}
    results: Dict[str, Result] = {}
    warm: Dict[str, float] = {}
    try:
        for mode in modes:  # one at a time: building and warming up are CPU-heavy
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, mode, config, str(device), args.threads, quiet_bf16), daemon=True)
            proc.start()
            child.close()
            msg = parent.recv()
            if msg[0] == "unavailable":
                results[mode] = Result(mode, unavailable=msg[1])
                proc.join(30)
                continue
            workers[mode] = (proc, parent)
            warm[mode] = msg[1]
            results[mode] = Result(mode, first_loss=msg[2])
        if not workers:
            return [results[m] for m in modes], {}
        total = args.steps
        estimate = total * sum(warm.values())
        if args.full or estimate > 60:
            print(f"Timed part: {total} steps per mode in {args.rounds} rounds, about {_duration(estimate)} "
                  f"(from the warm-up's step times: {', '.join(f'{m} {warm[m] * 1e3:.0f} ms' for m in workers)})", flush=True)
        times: Dict[str, List[float]] = {m: [] for m in workers}
        active = list(workers)
        done, started = 0, time.perf_counter()
        for r in range(args.rounds):
            n = total * (r + 1) // args.rounds - total * r // args.rounds  # at least 1: rounds <= steps
            order = active[r % len(active):] + active[: r % len(active)]
            this = {}
            for mode in order:
                time.sleep(0.02)  # let the previous worker's threads go idle
                workers[mode][1].send(("run", n))
                this[mode] = workers[mode][1].recv()
                times[mode].append(this[mode])
            done += n
            if args.progress:
                left = (time.perf_counter() - started) / done * (total - done)
                line = (f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {this[m] * 1e3:.1f} ms" for m in active)
                        + (f"; about {_duration(left)} left" if done < total else ""))
                sys.stderr.write(line + ("\n" if args.full else "\r"))
                sys.stderr.flush()
        if args.progress and not args.full:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
        speedups = round_speedups(times)
        for mode, (proc, conn) in workers.items():
            conn.send(("finish", None))
            res = results[mode]
            for k, v in conn.recv().items():
                setattr(res, k, v)
            res.ms_per_step = 1e3 * statistics.median(times[mode])
            res.ms_spread = spread(times[mode])
            if mode == "FP32":
                res.speedup = 1.0
            elif speedups.get(mode):
                res.speedup = statistics.median(speedups[mode])
                res.speedup_spread = spread(speedups[mode])
            proc.join(30)
    finally:
        for proc, conn in workers.values():
            if proc.is_alive():
                proc.terminate()
    return [results[m] for m in modes], times


def _matmul_seconds(rows: int, size: int, dtype: torch.dtype, device: torch.device, threads: int) -> float:
    """Seconds of one ``(rows, size) @ (size, size)`` matmul here, best of three
    (timed on a slice of at most 64 rows and scaled: a probe, not a benchmark).
    On a CPU it runs on one thread (the workers are forked from this process
    afterwards; it starts no thread pool before they are) and counts ``threads``
    as that many times faster."""
    probe = min(rows, 64)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(probe, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = math.inf
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return best * rows / probe / (threads if device.type == "cpu" else 1)


def estimate_seconds(modes: Sequence[str], args: argparse.Namespace, device: torch.device) -> float:
    """About how long the whole demo takes, before any of it runs: per mode its
    data (a matmul per batch, in FP32) and every step it trains
    (``MATMULS_PER_STEP`` matmuls each, in the mode's dtype), from one matmul
    of each dtype timed here. The other work of a step (the optimizer, the
    activations) is left out: the figure is a floor, good to a factor of two."""
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    per = {dt: _matmul_seconds(args.batch_size, args.size, dt, device, args.threads) for dt in {torch.float32, half}}
    steps = args.warmup + args.steps + 1
    return sum(args.batches * per[torch.float32] + steps * MATMULS_PER_STEP * per[torch.float32 if m == "FP32" else half]
               for m in modes)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def _mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def format_table(results: Sequence[Result]) -> str:
    """The comparison table: one row per mode, FP32 first."""
    head = ("mode", "time/step", "speedup", "loss first -> last", "peak memory", "layers ran in")
    rows = []
    for r in results:
        if r.unavailable:
            rows.append((r.mode, f"unavailable: {r.unavailable}"))
            continue
        speed = "-" if r.speedup is None else f"{r.speedup:.2f}x" + (f" ±{r.speedup_spread:.0%}" if r.mode != "FP32" else "")
        rows.append((r.mode, f"{r.ms_per_step:.1f} ms ±{r.ms_spread:.0%}", speed,
                     f"{r.first_loss:.4f} -> {r.final_loss:.4f}", _mib(r.peak_bytes), r.layers))
    full = [head] + [r for r in rows if len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]
    right = (1, 2, 3, 4)

    def fmt(r):
        if len(r) != len(head):
            return f"{r[0].ljust(widths[0])}  {r[1]}"
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join(fmt(r) for r in [head] + rows)


def _parser() -> argparse.ArgumentParser:
    p = SuggestingParser(
        prog="amp-patch demo",
        description="Train the Paddle AMP tutorial's SimpleNet in FP32, O1 and O2 and compare them, "
        "each mode in a worker process of its own, in interleaved rounds.",
    )
    p.add_argument("--size", type=int, default=None,
                   help="input and output width of each Linear (default 1024 on CPU, 4096 on CUDA)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows per batch (default 256 on CPU, 512 on CUDA; multiples of 8 suit GPU Tensor Cores)")
    p.add_argument("--batches", type=int, default=8, help="batches of random inputs, used in turn (default 8)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"timed steps per mode (default {STEPS})")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"rounds the timed steps are split into, each one block of steps per mode (default {ROUNDS})")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before the rounds, at least 1 (default 2)")
    p.add_argument("--full", action="store_true",
                   help="the tutorial's sizes and steps: --size 4096 --batch-size 512 --batches 50 --steps 250 "
                        "--rounds 10, with progress and an estimate of the time it takes")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train (default: CUDA if present, else CPU)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (default FP32,O1,O2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per mode (default: 1 on CPU, timed by its CPU time, which other work on "
                        "the machine does not change; more threads are timed by the wall clock)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="print each round's times (default: with --full, or when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _settings(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, List[str], torch.device]:
    p = _parser()
    args = p.parse_args(argv)
    if args.full:
        for k, v in FULL.items():
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; use --device cpu")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    for name, value in SIZES[device.type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("size", "batch_size", "batches", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rounds > args.steps:
        p.error(f"--rounds {args.rounds} is more than --steps {args.steps}: each round needs a step per mode")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first steps allocate and warm caches: timing them times that)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    modes = [m.strip().upper() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes a comma-separated subset of {','.join(MODES)}; got {args.modes!r}")
    if args.threads is None:
        args.threads = 1 if device.type == "cpu" else torch.get_num_threads()
    if args.progress is None:
        args.progress = args.full or sys.stderr.isatty()
    return args, modes, device


def _load() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; ``argv`` are the arguments after ``demo``.

    Args:
        argv: command-line arguments (``--size``, ``--full``, ``--device`` ...);
            ``None`` reads ``sys.argv[1:]``.

    Returns:
        the exit status: 0, or 2 for bad arguments (after printing usage).

    Example::

        from amp_patch.frontends import demo
        demo.main(["--size", "512", "--batches", "4"])
    """
    try:
        args, modes, device = _settings(argv)
    except SystemExit as e:  # argparse's usage errors and --help
        return e.code if isinstance(e.code, int) else 2
    load, cores = _load(), os.cpu_count() or 1
    half = "float16" if device.type == "cuda" else "bfloat16"
    timing = "CPU time" if args.threads == 1 and device.type == "cpu" else "wall clock"
    print(
        f"amp_patch demo: SimpleNet (3 x Linear {args.size}->{args.size}, ReLU), MSE loss, Adam; "
        f"batch {args.batch_size}; steps per mode: {step_counts(args.warmup, args.steps)}; "
        f"{device.type} ({'CUDA' if device.type == 'cuda' else 'CPU'} half dtype: {half})",
        flush=True,
    )
    print(f"Hardware: {hardware(device)}", flush=True)
    where = f"; load average {load:.1f} on {cores} cores at the start" if load is not None else ""
    print(f"Measured: each mode in its own process, {args.threads} thread{'s' if args.threads > 1 else ''} "
          f"(--threads), timed by its {timing}; modes interleaved in {args.rounds} rounds, medians ± spread "
          f"over rounds{where}", flush=True)
    emulated = device.type == "cpu" and not setup_checks.cpu_has_native_bf16()
    if emulated:
        print(f"Note: {NO_NATIVE_BF16} Expect O1 and O2 to be slower than FP32 in this run.", flush=True)
    estimate = estimate_seconds(modes, args, device)
    if args.full or estimate > 60:  # said before the long part starts: building the data and warming up count too
        print(f"This takes about {_duration(estimate)} or more: {len(modes)} modes, each building {args.batches} "
              f"batches and training {args.warmup + args.steps + 1} steps (from one matmul of this size timed "
              f"just now; a second estimate follows the warm-up)", flush=True)
    results, times = measure(modes, args, device, quiet_bf16=emulated)
    print()
    print(format_table(results))
    note = memory_note(results)
    if note:
        print("\n" + note)
    for r in results:
        if r.step:
            print("\n" + r.step)
    reasons = noise_verdict(times)
    speedups = round_speedups(times)
    if reasons:
        print(f"\nToo noisy to trust these figures: {'; '.join(reasons)}. Run it again with more --rounds, "
              f"or on a quieter machine.")
    elif speedups:
        worst = max(spread(v) for v in speedups.values())
        print(f"\nSteady: every speedup within ±{worst:.0%} over {args.rounds} rounds (judged noisy above "
              f"±{NOISY_SPREAD:.0%}; each speedup is a ratio within one round, so other work that slows every "
              f"mode alike cancels out).")
    if speedups and load is not None and load > cores:
        print(f"The load average was {load:.1f} on {cores} cores at the start: other work shares the machine; "
              f"the spread above is what it did to the speedups.")
    if emulated:
        print(
            f"\n{NO_NATIVE_BF16} The speedup needs a CPU that has them (a Xeon with AMX: "
            f"benchmarks/RESULTS.md in the source tree) or a CUDA GPU (FP16); the dtypes and losses above "
            f"are what any machine gives."
        )
    if not args.full:
        print("\nThe tutorial's sizes: amp-patch demo --full")
    return 0


if __name__ == "__main__":
    sys.exit(main())
