"""The benchmark suite: amp_patch vs FP32 vs torch.autocast, in one run.

This CPU's BF16 matmul speed swings 2-3x within seconds, so one long run per
mode means nothing. Each mode lives in its own worker process (amp_patch's
state is per process) and keeps its model and optimizer between blocks. The
coordinator runs the modes in short blocks of a few steps, rotates their order
every round, and reports each mode's ratio to the autocast block of the same
round; the figures are medians over rounds.

    python benchmarks/suite.py                     # all workloads, writes benchmarks/RESULTS.md
    python benchmarks/suite.py --workloads simplenet --rounds 5 --no-write
    python benchmarks/suite.py --quick             # tiny sizes, a smoke test

Peak memory is each worker's peak resident set growth (CPU) or peak CUDA
allocation; MFU is the step's matmul FLOPs over the half-dtype GEMM peak
measured in the same run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import MODES, Runner, build  # noqa: E402

WORKLOADS = ("simplenet", "transformer", "convnet", "smallops")


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(conn, workload, mode, device, half_name, scale, threads):
    torch.set_num_threads(threads)
    half = getattr(torch, half_name)
    base = _rss_mb()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wl = build(workload, gpu=device == "cuda", scale=scale)
    runner = Runner(wl, mode, device, half)
    for _ in range(2):  # warm-up: caches, allocator, first-call paths
        runner.step()
    _sync(device)
    conn.send(("ready", wl.flops_per_step))
    while True:
        cmd, arg = conn.recv()
        if cmd == "run":
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(arg):
                loss = runner.step()
            _sync(device)
            conn.send((time.perf_counter() - t0) / arg)
        elif cmd == "loss":
            conn.send(loss.item())
        elif cmd == "mem":
            if device == "cuda":
                conn.send(torch.cuda.max_memory_allocated() / 2**20)
            else:
                conn.send(_rss_mb() - base)
        else:
            conn.close()
            return


def gemm_peak(device, half, n=2048, reps=10) -> float:
    """FLOP/s of a large half-dtype GEMM, best of ``reps``."""
    a = torch.randn(n, n, device=device, dtype=half)
    b = torch.randn(n, n, device=device, dtype=half)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_workload(workload, modes, device, half, rounds, block, scale, threads) -> Dict:
    ctx = mp.get_context("spawn")
    procs, conns, flops = {}, {}, 0.0
    for mode in modes:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(child, workload, mode, device, str(half).split(".")[-1], scale, threads), daemon=True)
        p.start()
        procs[mode], conns[mode] = p, parent
        msg = parent.recv()  # start workers one at a time: building is CPU-heavy
        flops = msg[1]
    times: Dict[str, List[float]] = {m: [] for m in modes}
    ratios: Dict[str, List[float]] = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        this_round = {}
        for mode in order:
            time.sleep(0.05)  # let the previous worker's spinning threads go idle
            conns[mode].send(("run", block))
            this_round[mode] = conns[mode].recv()
            times[mode].append(this_round[mode])
        ref = this_round.get("autocast")
        for mode in modes:
            if ref:
                ratios[mode].append(this_round[mode] / ref)
    out = {"flops": flops, "modes": {}}
    for mode in modes:
        conns[mode].send(("loss", None))
        loss = conns[mode].recv()
        conns[mode].send(("mem", None))
        mem = conns[mode].recv()
        conns[mode].send(("stop", None))
        procs[mode].join(30)
        out["modes"][mode] = {
            "step_s": statistics.median(times[mode]),
            "ratio_autocast": statistics.median(ratios[mode]) if ratios[mode] else float("nan"),
            "loss": loss,
            "mem_mb": mem,
        }
    fp32 = out["modes"].get("fp32", {}).get("step_s")
    for mode, m in out["modes"].items():
        m["speedup_fp32"] = fp32 / m["step_s"] if fp32 else float("nan")
    return out


def table(results, peak, device, half) -> str:
    lines = [
        f"| workload | mode | step ms | speedup vs FP32 | ratio to autocast | peak mem MB | MFU | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for wl, res in results.items():
        for mode, m in res["modes"].items():
            mfu = res["flops"] / m["step_s"] / peak if peak else float("nan")
            lines.append(
                f"| {wl} | {mode} | {m['step_s'] * 1e3:.1f} | {m['speedup_fp32']:.2f}× | {m['ratio_autocast']:.2f} | "
                f"{m['mem_mb']:.0f} | {mfu:.1%} | {m['loss']:.4f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="amp_patch benchmark suite")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--block", type=int, default=3, help="steps per block")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink or grow the CPU sizes")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16"], help="default: BF16 on CPU, FP16 on CUDA")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke test)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch RESULTS.md")
    ap.add_argument("--output", default=str(HERE / "RESULTS.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.rounds, args.block = 0.125, 2, 1
    half = getattr(torch, args.dtype) if args.dtype else (torch.float16 if args.device == "cuda" else torch.bfloat16)
    torch.set_num_threads(args.threads)
    peak = gemm_peak(args.device, half, n=512 if args.quick else 2048)
    results = {}
    for wl in args.workloads:
        print(f"[suite] {wl}: {args.rounds} rounds x {len(args.modes)} modes x {args.block} steps", flush=True)
        results[wl] = run_workload(wl, list(args.modes), args.device, half, args.rounds, args.block, args.scale, args.threads)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    text = table(results, peak, args.device, half)
    header = (
        f"Device: {args.device} ({device_name}), {args.threads} threads, half dtype {str(half).split('.')[-1]}, "
        f"torch {torch.__version__}; {args.rounds} rounds of {args.block}-step blocks, order rotated each round; "
        f"medians. Half-dtype GEMM peak measured in this run: {peak / 1e12:.2f} TFLOP/s."
    )
    print(header)
    print(text)
    if not args.no_write:
        write_results(args.output, f"suite-{args.device}", header + "\n\n" + text + "\n\nCommand: `python benchmarks/suite.py " + " ".join(argv or sys.argv[1:]) + "`")
    return results


def write_results(path: str, key: str, body: str) -> None:
    """Replace the block between the ``key`` markers in RESULTS.md (or append it)."""
    p = Path(path)
    text = p.read_text() if p.exists() else "# Benchmark results\n"
    start, end = f"<!-- {key} -->", f"<!-- /{key} -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    p.write_text(text)


if __name__ == "__main__":
    main()
