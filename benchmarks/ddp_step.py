"""DDP step time and all-reduce volume: FP32 vs O2 (and O3) on workload 1.

Two processes on CPU with the gloo backend, one thread each, train the Paddle
tutorial's network (``workloads.build("simplenet")``) from the same init, each
rank on its own batches. For each mode the ranks wrap the model in
``DistributedDataParallel`` after ``amp_patch.initialize`` and count, with a
DDP communication hook, the bytes of every bucket they all-reduce and the
bucket dtypes. Modes run in short blocks whose order rotates every round;
step times are medians over blocks. A standalone all-reduce of one step's
volume, in FP32 and in the half dtype, shows what the communication costs.

    python benchmarks/ddp_step.py                      # fp32, O2, O3
    python benchmarks/ddp_step.py --scale 0.5 --rounds 2 --markdown

What the modes do to the volume: DDP reduces the gradients of the module it
wraps. Under O2 and O3 that module holds half-precision parameters, so the
buckets are half-precision and the volume halves; O2 then copies the reduced
half gradients into its FP32 masters (the sum is formed in the half dtype, as
Apex's O2 did without ``allreduce_always_fp32``).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))

import amp_patch  # noqa: E402
from workloads import build  # noqa: E402


class Volume:
    """State of the counting hook: bytes and dtypes of the buckets all-reduced."""

    def __init__(self) -> None:
        self.bytes = 0
        self.dtypes: set = set()


def counting_hook(state: Volume, bucket):
    buf = bucket.buffer()
    state.bytes += buf.numel() * buf.element_size()
    state.dtypes.add(str(buf.dtype).replace("torch.", ""))
    return default_hooks.allreduce_hook(None, bucket)


def _allreduce_ms(numel: int, dtype: torch.dtype, reps: int = 5) -> float:
    t = torch.ones(numel, dtype=dtype)
    dist.all_reduce(t)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def rank_main(rank: int, world: int, args, store: str, queue) -> None:
    torch.set_num_threads(args.threads)
    # A file store, not a TCP port another job on the machine could hold; a
    # lost peer fails the run in minutes instead of gloo's default half hour.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    half = getattr(torch, args.dtype)
    wl = build("simplenet", scale=args.scale, nbatches=2 * world)
    mine = wl.batches[rank::world]
    times = {m: [] for m in args.modes}
    volume, losses = {}, {}
    for r in range(args.rounds):
        k = r % len(args.modes)
        for mode in args.modes[k:] + args.modes[:k]:
            model = copy.deepcopy(wl.model)
            opt = torch.optim.SGD(model.parameters(), lr=wl.lr)
            if mode != "fp32":
                model, opt = amp_patch.initialize(model, opt, mode, half_dtype=half, verbosity=0)
            try:
                if args.verbose:
                    print(f"[rank {rank}] round {r} {mode}", file=sys.stderr, flush=True)
                ddp = DDP(model)
                vol = Volume()
                ddp.register_comm_hook(vol, counting_hook)

                def step(i):
                    x, y = mine[i % len(mine)]
                    opt.zero_grad(set_to_none=True)
                    loss = wl.loss_fn(ddp(x), y)
                    loss.backward()
                    opt.step()
                    return loss

                for i in range(2):  # warm-up: buckets are rebuilt after the first step
                    step(i)
                vol.bytes = 0
                dist.barrier()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    loss = step(i)
                dist.barrier()
                times[mode].append((time.perf_counter() - t0) / args.steps)
                volume[mode] = (vol.bytes / args.steps, sorted(vol.dtypes))
                losses[mode] = loss.item()
            finally:
                if mode != "fp32":
                    amp_patch.deinitialize()
    numel = sum(p.numel() for p in wl.model.parameters())
    comm = {"float32": _allreduce_ms(numel, torch.float32), args.dtype: _allreduce_ms(numel, half)}
    if rank == 0:
        queue.put({"times": times, "volume": volume, "losses": losses, "comm": comm, "numel": numel})
    dist.barrier()
    dist.destroy_process_group()


def table(res, args) -> str:
    fp32 = statistics.median(res["times"]["fp32"]) if "fp32" in res["times"] else None
    lines = [
        "| mode | step ms (median) | speedup vs FP32 | all-reduce MB/step | bucket dtype | final loss (rank 0) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        t = statistics.median(res["times"][mode])
        mb, dtypes = res["volume"][mode]
        speed = f"{fp32 / t:.2f}×" if fp32 else "n/a"
        lines.append(f"| {mode} | {t * 1e3:.1f} | {speed} | {mb / 2**20:.1f} | {', '.join(dtypes)} | {res['losses'][mode]:.5f} |")
    comm = ", ".join(f"{k} {v:.1f} ms" for k, v in res["comm"].items())
    lines.append("")
    lines.append(f"Standalone all-reduce of one step's {res['numel'] / 1e6:.1f} M gradients, best of 5: {comm}.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["fp32", "O2", "O3"], choices=["fp32", "O1", "O2", "O3"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink or grow workload 1's CPU size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="each rank says which block it runs")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(
            rank_main, args=(args.world, args, os.path.join(tmp, "store"), queue), nprocs=args.world,
            start_method="spawn", join=False,
        )
        # Read the result while waiting, so rank 0 never waits on a full pipe;
        # join() raises if a rank failed.
        res = None
        while res is None and not procs.join(timeout=1):
            if not queue.empty():
                res = queue.get()
        if res is None:
            res = queue.get()
        while not procs.join():
            pass
    header = (
        f"DDP, gloo, {args.world} processes x {args.threads} thread(s) on CPU, workload 1 at scale {args.scale}, "
        f"half dtype {args.dtype}, torch {torch.__version__}; {args.rounds} rounds of {args.steps}-step blocks, "
        f"order rotated each round."
    )
    print(header)
    print(table(res, args) if args.markdown else res)
    return res


if __name__ == "__main__":
    main()
