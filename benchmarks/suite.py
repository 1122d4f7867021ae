"""The benchmark suite: amp_patch vs FP32 vs torch.autocast, in one run.

This CPU's BF16 matmul speed swings 2-3x within seconds, so one long run per
mode means nothing. Each mode lives in its own worker process (amp_patch's
state is per process) and keeps its model and optimizer between blocks. The
coordinator runs the modes in short blocks (the same number of steps for every
mode, about a second for the slowest), rotates their order every round,
and reports each mode's ratio to the autocast block of the same round; the
figures are medians over rounds.

    python benchmarks/suite.py                     # all workloads; prints the table, writes nothing
    python benchmarks/suite.py --write             # the same, and rewrites its block of benchmarks/RESULTS.md
    python benchmarks/suite.py --workloads simplenet --rounds 5
    python benchmarks/suite.py --quick             # tiny sizes, a smoke test

A run writes a file only when asked: ``--write`` rewrites the suite's block of
``benchmarks/RESULTS.md``, ``--output PATH`` that block of PATH. ``--no-write``
is still accepted and changes nothing: not writing is the default.

Peak memory is each worker's peak resident set growth from before it built
its workload (CPU) or its peak CUDA allocation; MFU is the step's matmul FLOPs
over the half-dtype GEMM peak measured in the same run. On CPU each worker runs
one thread by default and its step time is the process's CPU time, so time the
core spent on other work on the machine does not count; the wall clock is
reported next to it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from workloads import APEX_MODES, MODES, OPT_IN_MODES, Runner, build  # noqa: E402

from amp_patch.frontends.demo import cpu_name  # noqa: E402

WORKLOADS = ("simplenet", "transformer", "convnet", "smallops")
GPU_WORKLOADS = ("gpt", "resnet")  # sized so an FP32 step takes well over 20 ms on a current GPU
#: the suite's speed and memory targets, checked at the end of a run (not with --quick or --no-assert):
#: (workload, mode, reference mode) -> the most its step may take, as a ratio to the
#: reference's (each a median of per-round ratios to autocast)
TARGETS = {
    ("simplenet", "O2", "autocast"): 0.85,
    ("transformer", "O2", "autocast"): 0.97,
    ("smallops", "O1-auto", "fp32"): 1.0,  # the tiny MLP: never slower than FP32
    ("simplenet", "O1-auto", "O1"): 1.02,
    ("transformer", "O1-auto", "O1"): 1.02,
}


def paired(res: Dict, mode: str, ref: str) -> tuple:
    """``mode``'s step time over ``ref``'s, taken within each round (the two
    blocks ran a second apart), then the median and quartiles over rounds."""
    ratios = sorted(r[mode] / r[ref] for r in res["rounds"] if mode in r and ref in r)
    return (statistics.median(ratios), *_quartiles(ratios)) if ratios else (float("nan"),) * 3


def target_rows(results: Dict) -> List[tuple]:
    """(workload, mode, reference, paired ratio, its IQR, the most it may be) for each target the run covers."""
    rows = []
    for (wl, mode, ref), most in TARGETS.items():
        res = results.get(wl)
        if res is not None and mode in res["modes"] and ref in res["modes"]:
            ratio, lo, hi = paired(res, mode, ref)
            rows.append((wl, mode, ref, ratio, (lo, hi), most))
    return rows


def missed_targets(results: Dict) -> List[str]:
    """The targets a run missed, in words: the ratios above, and O2's peak memory below autocast's."""
    missed = [f"{wl} {mode}: {ratio:.2f}x {ref}, target <= {most}"
              for wl, mode, ref, ratio, _, most in target_rows(results) if not ratio <= most]
    for wl, res in results.items():
        m = res["modes"]
        # the memory target is about models whose tensors outweigh the process's own growth
        # (smallops' 50 k parameters are 0.2 MB; its peak growth is the allocator's noise)
        if wl not in ("simplenet", "transformer"):
            continue
        if "O2" in m and "autocast" in m and not m["O2"]["mem_mb"] < m["autocast"]["mem_mb"]:
            missed.append(f"{wl} O2 peak memory {m['O2']['mem_mb']:.1f} MB, not below autocast's {m['autocast']['mem_mb']:.1f}")
    return missed


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
    try:
        wl = build(workload, gpu=device == "cuda", scale=scale)
        runner = Runner(wl, mode, device, half, copy_model=False)
        runner.step()  # a mode that cannot run (no Apex, no compiler) drops out here, not mid-round
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", 0.0))
        conn.close()
        return
    # One thread: the process's CPU time is the step time without the time
    # other work on the machine held the core. Several threads: wall clock.
    clock = time.process_time if threads == 1 and device == "cpu" else time.perf_counter
    warm = []
    for _ in range(3):  # warm-up: caches, allocator, first-call paths
        _sync(device)
        t0 = time.perf_counter()
        runner.step()
        _sync(device)
        warm.append(time.perf_counter() - t0)
    conn.send(("ready", wl.flops_per_step, min(warm)))
    loss = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "run" and device == "cuda":
            # CUDA events around the block: device time, no host clock in the way
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0 = time.perf_counter()
            start.record()
            for _ in range(arg):
                loss = runner.step()
            end.record()
            end.synchronize()
            conn.send((start.elapsed_time(end) / 1e3 / arg, (time.perf_counter() - w0) / arg))
        elif cmd == "run":
            _sync(device)
            c0, w0 = clock(), time.perf_counter()
            for _ in range(arg):
                loss = runner.step()
            _sync(device)
            conn.send(((clock() - c0) / arg, (time.perf_counter() - w0) / arg))
        elif cmd == "syncs":
            conn.send(count_syncs(runner) if device == "cuda" else float("nan"))
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


def count_syncs(runner, steps: int = 3) -> float:
    """Host syncs per training step, as ``torch.cuda.set_sync_debug_mode`` reports them."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                runner.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen) / steps


def gemm_peak(device, dtype, n=2048, reps=10) -> float:
    """FLOP/s of a large GEMM in ``dtype``, best of ``reps``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_workload(workload, modes, device, half, rounds, block_s, scale, threads) -> Dict:
    ctx = mp.get_context("spawn")
    procs, conns, flops, warm = {}, {}, 0.0, []
    for mode in modes:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(child, workload, mode, device, str(half).split(".")[-1], scale, threads), daemon=True)
        p.start()
        procs[mode], conns[mode] = p, parent
        msg = parent.recv()  # start workers one at a time: building is CPU-heavy
        if msg[0] == "error":
            print(f"[suite] {workload}: mode {mode} dropped: {msg[1]}", flush=True)
            p.join(30)
            del procs[mode], conns[mode]
            continue
        flops = msg[1]
        warm.append(msg[2])
    modes = [m for m in modes if m in conns]
    # Every mode runs the same number of steps per block (so the same batches),
    # enough for the slowest to take about block_s seconds.
    block = max(1, round(block_s / max(warm)))
    times: Dict[str, List[float]] = {m: [] for m in modes}
    walls: Dict[str, List[float]] = {m: [] for m in modes}
    ratios: Dict[str, List[float]] = {m: [] for m in modes}
    rounds_seen: List[Dict[str, float]] = []
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        this_round = {}
        for mode in order:
            time.sleep(0.05)  # let the previous worker's threads go idle
            conns[mode].send(("run", block))
            this_round[mode], wall = conns[mode].recv()
            times[mode].append(this_round[mode])
            walls[mode].append(wall)
        ref = this_round.get("autocast")
        for mode in modes:
            if ref:
                ratios[mode].append(this_round[mode] / ref)
        rounds_seen.append(this_round)
    out = {"flops": flops, "block": block, "modes": {}, "rounds": rounds_seen}
    for mode in modes:
        conns[mode].send(("loss", None))
        loss = conns[mode].recv()
        conns[mode].send(("mem", None))
        mem = conns[mode].recv()
        conns[mode].send(("syncs", None))
        syncs = conns[mode].recv()
        conns[mode].send(("stop", None))
        procs[mode].join(30)
        out["modes"][mode] = {
            "step_s": statistics.median(times[mode]),
            "wall_s": statistics.median(walls[mode]),
            "ratio_autocast": statistics.median(ratios[mode]) if ratios[mode] else float("nan"),
            "ratio_iqr": _quartiles(ratios[mode]),
            "loss": loss,
            "mem_mb": mem,
            "syncs": syncs,
        }
    fp32 = out["modes"].get("fp32", {}).get("step_s")
    for mode, m in out["modes"].items():
        m["speedup_fp32"] = fp32 / m["step_s"] if fp32 else float("nan")
    return out


def _quartiles(values: List[float]) -> tuple:
    if len(values) < 2:
        return (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return (q[0], q[2])


def table(results, peak) -> str:
    lines = [
        "| workload | mode | step ms | wall ms | speedup vs FP32 | ratio to autocast (IQR) | peak mem MB | MFU | host syncs/step | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl, res in results.items():
        for mode, m in res["modes"].items():
            mfu = res["flops"] / m["step_s"] / peak if peak else float("nan")
            lo, hi = m["ratio_iqr"]
            # no autocast (or no FP32) among the modes run: no ratio to give, not a NaN
            ratio = "-" if m["ratio_autocast"] != m["ratio_autocast"] else f"{m['ratio_autocast']:.2f} ({lo:.2f}–{hi:.2f})"
            speedup = "-" if m["speedup_fp32"] != m["speedup_fp32"] else f"{m['speedup_fp32']:.2f}×"
            lines.append(
                f"| {wl} | {mode} | {m['step_s'] * 1e3:.1f} | {m['wall_s'] * 1e3:.1f} | {speedup} | "
                f"{ratio} | {m['mem_mb']:.1f} | {mfu:.1%} | {m['syncs']:.1f} | {m['loss']:.5f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="amp_patch benchmark suite")
    ap.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS + GPU_WORKLOADS,
                    help=f"default: {' '.join(WORKLOADS)} on CPU, {' '.join(GPU_WORKLOADS)} on CUDA")
    ap.add_argument("--modes", nargs="+", default=[m for m in MODES if m not in OPT_IN_MODES], choices=MODES + APEX_MODES,
                    help="apex-O1/apex-O2 run NVIDIA Apex's own apex.amp (CUDA, an Apex checkout on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block-seconds", type=float, default=1.0, help="about how long one block of steps runs")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink or grow the CPU sizes")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16"], help="default: BF16 on CPU, FP16 on CUDA")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: 1 on CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke test)")
    ap.add_argument("--write", action="store_true",
                    help="write the table into its block of benchmarks/RESULTS.md (default: print only, write nothing)")
    ap.add_argument("--no-write", action="store_true",
                    help="print only (the default; accepted for older command lines)")
    ap.add_argument("--no-assert", action="store_true", help="do not check the targets (TARGETS) at the end")
    ap.add_argument("--output", default=None, metavar="PATH",
                    help="write the table into its block of PATH instead (implies --write)")
    args = ap.parse_args(argv)
    if args.output is not None:
        args.write = True
    if args.write and args.no_write:
        ap.error("--write (or --output) and --no-write contradict each other; give one")
    args.output = args.output or str(HERE / "RESULTS.md")
    if args.threads is None:
        # On a CPU shared with other work, every parallel region of a
        # multi-threaded op waits for its slowest thread: with another process
        # holding one of two cores, a 0.2 ms ReLU took 8 ms at two threads.
        args.threads = 1 if args.device == "cpu" else os.cpu_count()
    if args.workloads is None:
        args.workloads = list(GPU_WORKLOADS if args.device == "cuda" else WORKLOADS)
    if args.quick:
        args.scale, args.rounds, args.block_seconds = 0.125, 2, 0.05
    half = getattr(torch, args.dtype) if args.dtype else (torch.float16 if args.device == "cuda" else torch.bfloat16)
    torch.set_num_threads(args.threads)
    n = 512 if args.quick else 2048
    peak = gemm_peak(args.device, half, n=n)
    peak32 = gemm_peak(args.device, torch.float32, n=n, reps=3)
    results = {}
    for wl in args.workloads:
        print(f"[suite] {wl}: {args.rounds} rounds x {len(args.modes)} modes", flush=True)
        results[wl] = run_workload(wl, list(args.modes), args.device, half, args.rounds, args.block_seconds, args.scale, args.threads)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    text = table(results, peak)
    blocks = ", ".join(f"{wl} {r['block']}" for wl, r in results.items())
    clock = "process CPU time" if args.threads == 1 and args.device == "cpu" else ("CUDA-event time" if args.device == "cuda" else "wall clock")
    half_name = str(half).split(".")[-1]
    header = (
        f"Device: {args.device} ({device_name}), {args.threads} thread(s) per worker, half dtype {half_name}, "
        f"torch {torch.__version__}{' CUDA ' + str(torch.version.cuda) if args.device == 'cuda' else ''}. {args.rounds} rounds; each round runs every mode for one block of steps "
        f"(steps per block: {blocks}), in an order rotated each round. Step ms is the {clock} per step and "
        f"wall ms the wall clock, medians over rounds; the ratio to autocast is taken within each round, then the "
        f"median (IQR: its interquartile range over rounds). GEMM peak ({n}x{n}) measured in this run: {half_name} {peak / 1e12:.2f} TFLOP/s, float32 "
        f"{peak32 / 1e12:.2f} TFLOP/s ({peak / peak32:.1f}x)."
    )
    command = "python benchmarks/suite.py" + "".join(" " + a for a in (argv if argv is not None else sys.argv[1:]))
    rows = target_rows(results)
    if rows:
        # a target's ratio is taken within each round against its own reference mode,
        # not as a quotient of two medians of ratios to autocast (each with its own noise)
        text += "\n\nTargets (step time against a reference mode), each ratio taken within a round, median over rounds (IQR):\n\n" + "\n".join(
            ["| workload | mode | over | step-time ratio (IQR) | target | |", "|---|---|---|---|---|---|"]
            + [f"| {wl} | {mode} | {ref} | {r:.2f} ({lo:.2f}–{hi:.2f}) | ≤ {most} | {'met' if r <= most else 'missed'} |"
               for wl, mode, ref, r, (lo, hi), most in rows])
    print(header)
    print(text)
    if args.write:
        write_results(args.output, f"suite-{args.device}", header + "\n\n" + text + f"\n\nCommand: `{command}`")
        print(f"[suite] written into {args.output}")
    else:
        print("[suite] nothing written (--write puts the table into its block of benchmarks/RESULTS.md)")
    if not (args.quick or args.no_assert):
        missed = missed_targets(results)
        assert not missed, "targets missed: " + "; ".join(missed)
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
