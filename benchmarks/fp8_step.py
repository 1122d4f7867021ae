"""FP8 training step on a GPU: O6/O7 against O5 and ``torch.autocast`` BF16.

One training step (forward, backward, AdamW step) of a GPT-style decoder of
width 4096 (``--width``), each block's four ``nn.Linear`` layers 4096 x 12288,
4096 x 4096, 4096 x 16384 and 16384 x 4096: every one gains from FP8 by
torchao's shape rule, so O6/O7 convert them all (``fp8_layers="auto"``); the
LM head is the last layer and stays BF16. Modes:

* ``autocast``: the FP32 model under ``torch.autocast("cuda", torch.bfloat16)``,
  FP32 AdamW (the reference of the ratios);
* ``O5``: ``amp_patch.initialize(model, opt, opt_level="O5")``, BF16 model, FP32 masters;
* ``O6`` / ``O6-rowwise``: O5 with the Linear GEMMs in FP8 (torchao, tensorwise / rowwise);
* ``O7`` / ``O7-rowwise``: O6 with Adam's moments in FP8/BF16.

Each mode builds its model from one seed, warms up, then times ``--steps``
steps with CUDA events; modes run in rotated order for ``--rounds`` rounds and
each figure is the median over rounds. Reported per mode: median step time,
its ratio to O5's and to autocast's, peak memory, and the bytes of the
optimizer's state (the FP32 moments at autocast/O5/O6, FP8 + BF16 at O7).
``--compile`` (the default) compiles the model with ``torch.compile``, which
torchao's FP8 layers need to fuse their scaling into the matmuls.

Without a CUDA GPU with FP8 matrix multiplies (compute capability 8.9+) or
without torchao it prints why and exits 0 (``--cpu`` runs a tiny width on the
CPU instead, to check the script itself: CPU figures say nothing about FP8 speed).

    python benchmarks/fp8_step.py --markdown                      # width 4096, 4 blocks
    python benchmarks/fp8_step.py --blocks 2 --rounds 1           # a quicker look
    python benchmarks/fp8_step.py --cpu --width 64 --heads 2 --seq 32 --batch 2 --vocab 64 --blocks 1 \
        --steps 2 --warmup 1 --rounds 1 --no-compile --fp8-layers all                    # the script, on a CPU
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.base.errors import ConfigError
from amp_patch.precision import fp8, lowstate

MODES = ["autocast", "O5", "O6", "O7", "O6-rowwise", "O7-rowwise"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, blocks: int, heads: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def unavailable(device: str) -> str:
    """Why this machine cannot run the benchmark's FP8 modes, or ""."""
    try:
        fp8.torchao()
    except ConfigError as e:
        return str(e)
    if device == "cpu":
        return ""
    if not torch.cuda.is_available():
        return "no CUDA GPU here; FP8 matrix multiplies need one of compute capability 8.9+ (Ada, Hopper, Blackwell)"
    return fp8.cuda_refusal(torch.cuda.get_device_capability(), torch.cuda.get_device_name())


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.ms = self.a.elapsed_time(self.b)
        else:
            self.ms = (time.perf_counter() - self.t) * 1000


def run_mode(mode: str, args) -> dict:
    device = args.device
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.width, args.blocks, args.heads, args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    level, _, recipe = mode.partition("-")
    if mode != "autocast":
        kw = dict(fp8_recipe=recipe) if recipe else {}
        if level in ("O6", "O7"):
            kw["fp8_layers"] = args.fp8_layers
        model, opt = amp_patch.initialize(model, opt, level, verbosity=0, **kw)
    step_model = torch.compile(model) if args.compile else model
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device, generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ctx = (lambda: torch.autocast(device, torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext

    def step():
        with ctx():
            loss = F.cross_entropy(step_model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            with Timer(device) as t:
                loss = step()
            times.append(t.ms)
        out = {
            "ms": statistics.median(times),
            "loss": float(loss),
            "state_mb": lowstate.state_bytes(opt) / 2**20,
            "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan"),
            "fp8_layers": sum(r["runs_in"] == "float8" for r in amp_patch.report().fp8) if mode != "autocast" else 0,
        }
    finally:
        if amp_patch.is_initialized():
            amp_patch.deinitialize()
    return out


def table(res: dict, args) -> str:
    o5 = statistics.median(r["ms"] for r in res["O5"]) if "O5" in res else None
    ac = statistics.median(r["ms"] for r in res["autocast"]) if "autocast" in res else None
    rows = [
        f"width {args.width}, {args.blocks} blocks, {args.heads} heads, batch {args.batch} x {args.seq} tokens, "
        f"{'compiled' if args.compile else 'eager'}, {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""),
        "",
        "| mode | FP8 layers | step ms | / O5 | / autocast | peak MB | optimizer state MB | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in res.items():
        ms = statistics.median(r["ms"] for r in runs)
        last = runs[-1]
        to_o5 = f"{ms / o5:.2f}" if o5 else "-"
        to_ac = f"{ms / ac:.2f}" if ac else "-"
        rows.append(f"| {mode} | {last['fp8_layers']} | {ms:.1f} | {to_o5} | {to_ac} | {last['peak_mb']:.0f} | "
                    f"{last['state_mb']:.2f} | {last['loss']:.4f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--fp8-layers", default="auto", choices=["auto", "all"],
                    help="O6/O7's fp8_layers (all: below the shape rule's sizes too, e.g. with --cpu)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (to check the script; no FP8 speed there)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.cpu else "cuda"
    why = unavailable(args.device)
    if why:
        print(f"fp8_step: skipped: {why}")
        return 0
    res: dict = {m: [] for m in args.modes}
    for r in range(args.rounds):
        order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
        for mode in order:
            res[mode].append(run_mode(mode, args))
            gc.collect()  # the mode's model, optimizer and compiled graphs, before the next mode's peak
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"round {r + 1}/{args.rounds} {mode}: {res[mode][-1]['ms']:.1f} ms", file=sys.stderr, flush=True)
    print(table(res, args) if args.markdown else res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
