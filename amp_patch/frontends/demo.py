"""``amp-patch demo``: the Paddle AMP tutorial's benchmark, with amp_patch.

Trains the tutorial's SimpleNet (three ``Linear`` layers, ReLU after the
first two, MSE loss) in FP32, then under O1 and O2, on the best device there
is (CUDA with FP16, else the CPU with BF16), and prints the tutorial's
comparison: time per step, speedup over FP32, the loss at the first and the
last step, peak memory, and the dtypes the layers ran in. The tutorial fits
random targets with SGD at lr 1e-4, where the loss never moves; here the
targets are a fixed linear map of the inputs and the optimizer is Adam, so
the loss column shows each mode learning the same thing.

The default sizes finish in well under a minute on two CPU cores with BF16
instructions (about a minute where torch emulates BF16); ``--full``
runs the tutorial's own sizes (4096 wide, batch 512, 50 batches, 5 epochs).
"""
from __future__ import annotations

__amp_patch_frame__ = "user"  # frames.py: its training loop runs as a user's would

import argparse
import dataclasses
import gc
import sys
import time
import warnings
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import frontend
from ..diagnostics import AmpWarning, setup_checks
from ..errors import ConfigError
from ..diagnostics.stats import dtype_name
from ..scaling.checkpoint import counters

MODES = ("FP32", "O1", "O2")
NO_NATIVE_BF16 = (
    "This CPU has no BF16 instructions (AVX512_BF16, AMX or Arm BF16), so torch emulates BF16 math "
    "on it, far slower than FP32."
)
FULL = dict(size=4096, batch_size=512, batches=50, epochs=5)


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
    """One row of the table; ``unavailable`` says why a mode did not run."""

    mode: str
    ms_per_step: float = 0.0
    first_loss: float = 0.0
    final_loss: float = 0.0
    peak_bytes: Optional[int] = None
    layers: str = ""
    unavailable: str = ""
    step: str = ""  # O2: which optimizer step ran


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


# ------------------------------------------------------------------ progress


class _Progress:
    """tqdm when installed, else a plain bar; silent when ``enabled`` is False."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled, self.n = total, label, enabled, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, leave=False, file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            return
        done = int(30 * self.n / self.total)
        sys.stderr.write(f"\r{self.label:>5} [{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * (len(self.label) + 45) + "\r")
            sys.stderr.flush()


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


def run(mode: str, data: Sequence[Tuple[torch.Tensor, torch.Tensor]], args: argparse.Namespace,
        device: torch.device) -> Result:
    """Train a fresh SimpleNet in ``mode`` ("FP32" or an opt level) and measure it."""
    torch.manual_seed(args.seed)
    model = SimpleNet(args.size, args.size).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    if mode != "FP32":
        try:
            model, optimizer = frontend.initialize(model, optimizer, opt_level=mode)
        except ConfigError as e:
            return Result(mode, unavailable=str(e))

    def step(x, label):
        loss = loss_fn(model(x), label)  # the tutorial's loop, unchanged
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    try:
        steps = args.epochs * len(data)
        bar = _Progress(args.warmup + steps, mode, args.progress)
        for i in range(args.warmup + steps):
            if i == args.warmup:
                _sync(device)
                start = time.perf_counter()
            loss = step(*data[i % len(data)])
            if i == 0:
                first_loss = float(loss.detach())
            bar.update()
        _sync(device)
        elapsed = time.perf_counter() - start
        bar.close()
        final_loss = float(loss.detach())
        layers = _layer_dtypes(model, *data[0], loss_fn)
        peak = _peak_memory(lambda: step(*data[0]), model, optimizer, data[0], device)
        kind = _step_kind(mode)
    finally:
        if mode != "FP32":
            frontend.deinitialize()
    return Result(mode, 1000.0 * elapsed / steps, first_loss, final_loss, peak, layers, step=kind)


def _step_kind(mode: str) -> str:
    """Which optimizer step an O2/O5 run took: the default one-pass step, or the plain one."""
    if mode not in ("O2", "O5"):
        return ""
    c = counters()
    one, total = c["optimizers"][0]["one_pass"], c["steps"]
    if one:
        return f"{mode}'s optimizer step (the default, no option): one pass in C per parameter for {one} of {total} steps"
    return f"{mode}'s optimizer step: the plain step (the one-pass C step is not built here)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def format_table(results: Sequence[Result]) -> str:
    """The comparison table: one row per mode, FP32 first."""
    base = next((r.ms_per_step for r in results if r.mode == "FP32" and not r.unavailable), None)
    head = ("mode", "time/step", "speedup", "loss first -> last", "peak memory", "layers ran in")
    rows = []
    for r in results:
        if r.unavailable:
            rows.append((r.mode, f"unavailable: {r.unavailable}"))
            continue
        speed = f"{base / r.ms_per_step:.2f}x" if base and r.ms_per_step else "-"
        rows.append((r.mode, f"{r.ms_per_step:.1f} ms", speed, f"{r.first_loss:.4f} -> {r.final_loss:.4f}", _mib(r.peak_bytes), r.layers))
    full = [head] + [r for r in rows if len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]
    right = (1, 2, 3, 4)

    def fmt(r):
        if len(r) != len(head):
            return f"{r[0].ljust(widths[0])}  {r[1]}"
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join(fmt(r) for r in [head] + rows)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="amp-patch demo",
        description="Train the Paddle AMP tutorial's SimpleNet in FP32, O1 and O2 and compare them.",
    )
    p.add_argument("--size", type=int, default=1024, help="input and output width of each Linear (default 1024)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="rows per batch (default 256; multiples of 8 suit GPU Tensor Cores)")
    p.add_argument("--batches", type=int, default=8, help="batches of random inputs (default 8)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the batches (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (default 2)")
    p.add_argument("--full", action="store_true",
                   help="the tutorial's sizes: --size 4096 --batch-size 512 --batches 50 --epochs 5")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train (default: CUDA if present, else CPU)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (default FP32,O1,O2)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's own choice); 1 steadies timings on a busy machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show a progress bar (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _settings(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, List[str], torch.device]:
    p = _parser()
    args = p.parse_args(argv)
    if args.full:
        for k, v in FULL.items():
            setattr(args, k, v)
    for name in ("size", "batch_size", "batches", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    modes = [m.strip().upper() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes a comma-separated subset of {','.join(MODES)}; got {args.modes!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; use --device cpu")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.progress is None:
        args.progress = sys.stderr.isatty()
    return args, modes, torch.device("cuda" if cuda else "cpu")


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
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    half = "float16" if device.type == "cuda" else "bfloat16"
    steps = args.epochs * args.batches
    print(
        f"amp_patch demo: SimpleNet (3 x Linear {args.size}->{args.size}, ReLU), MSE loss, Adam; "
        f"batch {args.batch_size}, {steps} timed steps after {args.warmup} warm-up; "
        f"{device.type} ({'CUDA' if device.type == 'cuda' else 'CPU'} half dtype: {half})",
        flush=True,
    )
    data = make_data(args.size, args.batch_size, args.batches, args.seed, device)
    emulated = device.type == "cpu" and not setup_checks.cpu_has_native_bf16()
    if emulated:
        print(f"Note: {NO_NATIVE_BF16} Expect O1 and O2 to be slower than FP32 in this run.", flush=True)
    with warnings.catch_warnings():
        if emulated:  # said once above, not once per mode
            warnings.filterwarnings("ignore", message=".*without native BF16", category=AmpWarning)
        results = [run(mode, data, args, device) for mode in modes]
    print()
    print(format_table(results))
    for r in results:
        if r.step:
            print("\n" + r.step)
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
