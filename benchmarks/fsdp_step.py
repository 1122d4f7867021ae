"""FSDP2 (``fully_shard``): per-rank peak memory and step time of amp_patch's O1
and O2 against FSDP's own mixed-precision policy without amp_patch, on one model.

Each mode runs in its own gloo process group of ``--world`` CPU processes (one
thread each), so each rank's memory figures are its own: the model is built on
the meta device, sharded block by block and then at the root, materialized
(``to_empty``) and initialized from one seed; memory is counted from just
before that. Two figures per rank: the peak of the C heap in use (glibc's
``mallinfo2``, which every CPU tensor is allocated from), sampled after each
block's forward, at each block's gradient in the backward and after each
backward and step, which counts tensors and not the code pages the first
kernels touch; and the peak resident-set growth, which counts everything.
Every rank trains on its own batches with AdamW. Modes:

* ``fsdp-bf16``: no amp_patch; ``fully_shard(..., mp_policy=MixedPrecisionPolicy(
  param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`` (the reference);
* ``O2``: amp_patch.initialize(model, opt, opt_level="O2") on the model sharded
  with FSDP's default policy: amp_patch gives FSDP the same policy (the model
  holds no batch norm) and steps each rank's shards in one pass;
* ``O1``: amp_patch.initialize(model, opt, opt_level="O1"): the sharded FP32
  parameters gathered in FP32, the ops cast by the patched functions;
* ``fsdp-fp32``: no amp_patch, FSDP's default policy (FP32 throughout);
* ``O2-ddp``: no sharding: amp_patch's O2 with its own FP32 masters on each
  rank, the model wrapped in ``DistributedDataParallel`` (what O2 on several
  processes was before ``fully_shard``).

Rounds run the modes in rotated order; each figure is the median over
rounds. Ratios are to ``fsdp-bf16``.

    python benchmarks/fsdp_step.py                       # d 768, 6 blocks, 2 ranks
    python benchmarks/fsdp_step.py --width 256 --blocks 2 --rounds 1 --markdown   # a quick look
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import amp_patch
from amp_patch.precision import fsdp

MODES = ["fsdp-bf16", "O2", "O1", "fsdp-fp32", "O2-ddp"]


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(blocks)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class Heap:
    """The C heap in use (small blocks and mmapped ones), and its peak over the samples taken."""

    def __init__(self):
        try:
            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallinfo2.restype = _MallInfo2
        except (OSError, AttributeError):
            self.libc = None  # not glibc 2.33+: the resident set only
        self.base = self.now()
        self.peak = self.base

    def now(self) -> float:
        if self.libc is None:
            return 0.0
        m = self.libc.mallinfo2()
        return (m.uordblks + m.hblkhd) / 2**20

    def sample(self, *args) -> None:
        self.peak = max(self.peak, self.now())

    def watch(self, module: nn.Module) -> None:
        """Sample after ``module``'s forward and when its output's gradient arrives."""
        def after(m, inputs, output):
            self.sample()
            if output.requires_grad:
                output.register_hook(lambda g: self.sample())
        module.register_forward_hook(after)


def rank_main(rank: int, world: int, args, mode: str, store: str, queue) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    rows = args.batch * args.tokens  # tokens flattened: a 2-d output, no view for FSDP to warn about
    batches = [(torch.randn(rows, args.width, generator=g), torch.randn(rows, args.width, generator=g))
               for _ in range(2)]
    base = _rss_mb()
    heap = Heap()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mode == "fsdp-bf16" \
        else MixedPrecisionPolicy()
    ddp = mode == "O2-ddp"
    amp_on = mode.startswith("O")
    with torch.device("cpu" if ddp else "meta"):
        model = Net(args.width, args.blocks)
    if not ddp:
        for b in model.blocks:
            fully_shard(b, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to_empty(device="cpu")
    torch.manual_seed(1234 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p if ddp else p.to_local()
            if name.endswith("bias"):
                local.zero_()
            elif "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    for b in model.blocks:
        heap.watch(b)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    net = model
    if amp_on:
        model, opt = amp_patch.initialize(model, opt, mode[:2], half_dtype=torch.bfloat16, verbosity=0)
        net = DDP(model) if ddp else model
    try:
        def step(i):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(net(x).float(), y)
            loss.backward()
            heap.sample()
            opt.step()
            heap.sample()
            return loss

        for i in range(2):
            step(i)
        dist.barrier()
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            loss = step(i)
            times.append(time.perf_counter() - t0)
        dist.barrier()
        masters = list(amp_patch.master_params(opt)) if amp_on else list(model.parameters())
        shard = sum(fsdp.local(p).numel() * fsdp.local(p).element_size() for p in masters)
        whole = sum(p.numel() * p.element_size() for p in masters)
        one_pass = amp_patch.counters()["optimizers"][0]["one_pass"] if amp_on else 0
        out = dict(step_s=statistics.median(times), peak_mb=_rss_mb() - base, heap_mb=heap.peak - heap.base,
                   shard_mb=shard / 2**20,
                   whole_mb=whole / 2**20, loss=loss.item(), one_pass=one_pass)
    finally:
        if amp_on:
            amp_patch.deinitialize()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def run_mode(args, mode: str):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(rank_main, args=(args.world, args, mode, os.path.join(tmp, "store"), queue),
                                   nprocs=args.world, start_method="spawn", join=False)
        res = None
        while res is None and not procs.join(timeout=1):
            if not queue.empty():
                res = queue.get()
        if res is None:
            res = queue.get()
        while not procs.join():
            pass
    return res


def table(results, args) -> str:
    ref = results["fsdp-bf16"]
    ref_t = statistics.median(r[0]["step_s"] for r in ref)
    ref_m = [statistics.median(r[k]["peak_mb"] for r in ref) for k in range(args.world)]
    ref_h = [statistics.median(r[k]["heap_mb"] for r in ref) for k in range(args.world)]
    lines = [
        "| mode | step ms (rank 0) | step / fsdp-bf16 | heap peak MB per rank | heap peak / fsdp-bf16 | "
        "RSS growth MB per rank | RSS / fsdp-bf16 | FP32 master MB per rank (whole) | one-pass steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        rs = results[mode]
        t = statistics.median(r[0]["step_s"] for r in rs)
        peaks = [statistics.median(r[k]["peak_mb"] for r in rs) for k in range(args.world)]
        heaps = [statistics.median(r[k]["heap_mb"] for r in rs) for k in range(args.world)]
        last = rs[-1]
        lines.append(
            f"| {mode} | {t * 1e3:.0f} | {t / ref_t:.2f} | {' / '.join(f'{p:.0f}' for p in heaps)} | "
            f"{' / '.join(f'{p / m:.2f}' for p, m in zip(heaps, ref_h))} | {' / '.join(f'{p:.0f}' for p in peaks)} | "
            f"{' / '.join(f'{p / m:.2f}' for p, m in zip(peaks, ref_m))} | "
            f"{' / '.join(format(x['shard_mb'], '.1f') for x in last)} ({last[0]['whole_mb']:.1f}) | {last[0]['one_pass']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode and round (after 2 warm-up steps)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if "fsdp-bf16" not in args.modes:
        args.modes = ["fsdp-bf16"] + args.modes
    results = {m: [] for m in args.modes}
    for r in range(args.rounds):
        k = r % len(args.modes)
        for mode in args.modes[k:] + args.modes[:k]:
            print(f"round {r}: {mode}", file=sys.stderr, flush=True)
            results[mode].append(run_mode(args, mode))
    header = (
        f"FSDP2 fully_shard, gloo, {args.world} processes x 1 thread on CPU, torch {torch.__version__}; model: "
        f"{args.blocks} blocks (LayerNorm, Linear {args.width}->{4 * args.width}, GELU, Linear back), batch "
        f"{args.batch}x{args.tokens} tokens, AdamW, BF16; {args.rounds} round(s) of {args.steps} timed steps per mode, "
        f"each mode in fresh processes; memory counted from before the model was materialized."
    )
    print(header)
    print(table(results, args) if args.markdown else results)
    return results


if __name__ == "__main__":
    main()
