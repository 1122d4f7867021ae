"""The O2 optimizer step alone: plain (three passes), compiled ``fused_update=True``, one-pass C.

    nice python benchmarks/fused_update.py [--markdown] [--dtype float16] [--threads N] [--no-assert]

Workload 1's parameters (three 2048x2048 Linear layers) at O2 (BF16 by
default; ``--dtype float16`` adds the loss scale's check and unscale), their half
gradients made by a cheap backward (``sum(p * g)``), then ``optimizer.step()`` timed with no forward or
backward around it, for SGD, SGD with momentum and AdamW:

- ``plain``: the O2 step without the kernel (copy the gradients into FP32, the
  optimizer's own update, copy the masters into the model);
- ``compiled``: ``fused_update=True`` with the kernel left out (torch.compile);
- ``one-pass``: the default O2 step, the C kernel (``amp_patch/precision/_onepass.c``).

The three run in interleaved blocks whose order rotates, and each ratio is
taken per block (median over blocks), so a machine shared with other work
skews all three alike. The one-pass step's memory traffic (the bytes it must
read and write per parameter) over its time is set against a plain copy's
bandwidth measured in the same run, at the same thread count.

Target, asserted unless ``--no-assert``: the one-pass step at least
as fast as the compiled one for every optimizer.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import amp_patch
from amp_patch.precision import onepass

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-4),
    "SGD momentum 0.9": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
}
#: bytes the one-pass step must move per parameter: gradient (half) read, master read and
#: written, state read and written, half weight written
STATE_BYTES = {"SGD": 0, "SGD momentum 0.9": 8, "AdamW": 16}
MODES = ("plain", "compiled", "one-pass")


class Stepper:
    """One O2 model and optimizer under one mode; ``step()`` times one optimizer step."""

    def __init__(self, name: str, mode: str, width: int, half: torch.dtype):
        torch.manual_seed(0)
        self.mode, self.half = mode, half
        self.model = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
        self.opt = OPTIMIZERS[name](self.model.parameters())
        with self.session():
            g = torch.Generator().manual_seed(1)
            self.grads = [torch.randn(p.shape, generator=g).to(p.dtype) * 1e-3 for p in self.model.parameters()]
            for _ in range(3):  # optimizer state, then the compile
                self.step()

    def session(self):
        return _Session(self)

    def step(self) -> float:
        self.opt.zero_grad()
        # a backward whose gradients are self.grads, without the GEMMs
        sum((p * g).sum() for p, g in zip(self.model.parameters(), self.grads)).backward()
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t


class _Session:
    """amp_patch initialized for one stepper's mode (its state is per process: one at a time)."""

    def __init__(self, s: Stepper):
        self.s = s

    def __enter__(self):
        s = self.s
        self.native = onepass.native
        if s.mode != "one-pass":
            onepass.native = None  # as where the kernel is not built
        model, opt = amp_patch.initialize(s.model, s.opt, "O2", half_dtype=s.half,
                                          fused_update=s.mode == "compiled", verbosity=0)
        s.model, s.opt = model, opt
        return s

    def __exit__(self, *exc):
        c = amp_patch.counters()["optimizers"][0]
        amp_patch.deinitialize()
        onepass.native = self.native
        if not any(exc):
            want = {"plain": (0, 0), "compiled": (None, 0), "one-pass": (0, None)}[self.s.mode]
            got = (c["fused"], c["one_pass"])
            assert all(w is None or w == g for w, g in zip(want, got)), f"{self.s.mode} took another step: {c}"


class Copy:
    """A plain FP32 copy as large as the masters: the machine's copy bandwidth, timed
    in the same blocks as the steps (``step()`` returns seconds, ``nbytes`` read + written)."""

    def __init__(self, n: int):
        self.src, self.dst = torch.ones(n), torch.empty(n)
        self.nbytes = 8 * n

    def step(self) -> float:
        t = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t


def measure(name: str, width: int, blocks: int, reps: int, half: torch.dtype) -> dict:
    steppers = {mode: Stepper(name, mode, width, half) for mode in MODES}
    copy = Copy(sum(p.numel() for p in steppers["plain"].model.parameters()))
    times = {mode: [] for mode in MODES + ("copy",)}
    for b in range(blocks):
        order = MODES[b % 3:] + MODES[:b % 3]
        for mode in order:
            with steppers[mode].session() as s:
                times[mode].append(statistics.median(s.step() for _ in range(reps)))
        times["copy"].append(statistics.median(copy.step() for _ in range(reps)))
    ms = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
    ratio = {mode: statistics.median(x / p for x, p in zip(times[mode], times["plain"])) for mode in MODES}
    vs_compiled = statistics.median(o / c for o, c in zip(times["one-pass"], times["compiled"]))
    copy_bw = statistics.median(copy.nbytes / t for t in times["copy"])
    # the step's bandwidth over the copy's, block by block
    of_copy = [t_copy / copy.nbytes for t_copy in times["copy"]]
    return {"ms": ms, "ratio": ratio, "vs_compiled": vs_compiled, "copy_bw": copy_bw, "copy_s_per_byte": of_copy,
            "one_pass_s": times["one-pass"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="float16 adds the dynamic loss scale: the inf/NaN check and the unscale")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--no-assert", action="store_true", help="report only; do not check the target")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    half = getattr(torch, args.dtype)
    if onepass.native is None:
        raise SystemExit(f"the one-pass step is not built here ({onepass.UNAVAILABLE}); build it with "
                         f"`python setup.py build_ext --inplace`")
    rows = [(name, measure(name, args.width, args.blocks, args.reps, half)) for name in OPTIMIZERS]
    n = 3 * (args.width * args.width + args.width)
    check = 2 if args.dtype == "float16" else 0  # the inf/NaN pass reads each half gradient once more
    print(f"O2 {args.dtype} optimizer step, {n / 1e6:.1f} M parameters, {args.threads} thread(s), torch "
          f"{torch.__version__}, kernel isa {onepass.native.isa()}; copy bandwidth (FP32 copy as large as the "
          f"masters, same blocks) {statistics.median(r['copy_bw'] for _, r in rows) / 1e9:.1f} GB/s")
    lines = ["| optimizer | plain ms | compiled ms | one-pass ms | compiled / plain | one-pass / plain | "
             "one-pass / compiled | one-pass GB/s (of copy) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        nbytes = n * (12 + STATE_BYTES[name] + check)
        gbs = nbytes / (r["ms"]["one-pass"] / 1e3)
        # per block: (step bytes / step time) / (copy bytes / copy time)
        share = statistics.median(nbytes / t / (1 / c) for t, c in zip(r["one_pass_s"], r["copy_s_per_byte"]))
        lines.append(f"| {name} | {r['ms']['plain']:.1f} | {r['ms']['compiled']:.1f} | {r['ms']['one-pass']:.1f} | "
                     f"{r['ratio']['compiled']:.2f} | {r['ratio']['one-pass']:.2f} | {r['vs_compiled']:.2f} | "
                     f"{gbs / 1e9:.1f} ({share:.0%}) |")
    print("\n".join(lines if args.markdown else [ln.replace("|", " ").strip() for ln in lines if "---" not in ln]))
    if not args.no_assert:
        slow = [(name, r["vs_compiled"]) for name, r in rows if r["vs_compiled"] > 1.0]
        assert not slow, f"target missed: the one-pass step slower than the compiled one for {slow}"
    return rows


if __name__ == "__main__":
    main()
