"""``amp-patch compare``: does mixed precision change what *your* script computes?

``amp-patch compare [options] SCRIPT [ARGS ...]`` runs an unmodified training
script through the launcher once per opt level (default FP32, O1 and O2 in the
machine's half dtype: BF16 on a CPU, FP16 on a GPU), each in a process of its
own with the same seed, for ``--steps`` steps, and follows every
``loss.backward()``: the loss, whether the optimizer step after it was
skipped, the loss scale and the time from one backward to the next. It then
prints a table (final loss, its gap to FP32, skipped steps, speedup) and says
in words when a level diverged (an inf/NaN loss, every step skipped from some
point on, or a loss that ended above where it started while FP32's fell), when
its loss first departed from FP32's by more than ``--threshold``, and which op
the overflow provenance names: a level that diverged or kept skipping steps is
run once more with ``find_overflow`` armed at every step, up to its first
problem step, so that the timed run is not slowed by the watch.

Files, in ``--out`` (default ``amp_patch_compare``): ``compare.csv`` (one row
per level and backward), ``compare.png`` (the loss, its gap to FP32 and the
loss scale over the steps; needs matplotlib) and each level's output,
``LEVEL.log``.

How it follows the script (the child side, ``child()``): a wrapper on
``torch.Tensor.backward`` sees each backward of a one-element loss; where
amp_patch scales that loss, it takes the true loss amp_patch recorded
(``diagnostics.losses``), since what reaches the wrapper is the scaled one.
At the ``--steps + 1``-th backward the script is stopped (the step before it
has run). A script that calls ``amp.initialize`` / ``amp_patch.initialize``
itself gets each level's opt level and half dtype in its call (its
level-specific options, such as ``keep_batchnorm_fp32``, are dropped; its
loss scale is kept, except at FP32).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import difflib
import importlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import frontend
from ..base import running
from ..base.errors import AmpError
from ..diagnostics import last_overflow, losses
from . import launcher, scan

PROG = "amp-patch compare"
#: what each level name runs: (opt level, half dtype or None for the machine's default)
LEVELS: Dict[str, Tuple[str, Optional[str]]] = {
    "FP32": ("O0", None), "O0": ("O0", None), "O1": ("O1", None), "O2": ("O2", None), "O3": ("O3", None),
    "O4": ("O4", "bfloat16"), "O5": ("O5", "bfloat16"),
}
DEFAULT_LEVELS = ("FP32", "O1", "O2")
CSV_FIELDS = ("level", "opt_level", "half_dtype", "step", "loss", "skipped", "loss_scale", "step_time_s")
#: options a script's own initialize loses when compare sets the level: they belong to one level
LEVEL_OPTIONS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                 "cast_model_outputs")
#: how long one level may run (seconds), unless --timeout says otherwise
DEFAULT_TIMEOUT = 3600.0


class StopRun(BaseException):
    """Raised from inside the script's ``--steps + 1``-th backward: enough steps.

    A BaseException, so that the script's own ``except Exception`` does not catch it.
    """


# ============================================================ the child side


def _seed(seed: int) -> None:
    random.seed(seed)
    try:
        importlib.import_module("numpy").random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)  # every device's generator, CUDA's included


class _Follower:
    """Follows the script's backwards (installed on ``torch.Tensor.backward``
    before the launcher, so that amp_patch's own backward patch, when a level
    has one, is the outer wrapper and hands this one the scaled loss)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.rows: List[Dict[str, Any]] = []
        #: the state at the backward that stopped the run (the last row's "next")
        self.end: Optional[Dict[str, Any]] = None
        self.values: List[Any] = []  # one-element tensors, read on the host at the end
        self.provenances: List[Any] = []
        self._seen_log: Dict[int, int] = {}  # id(session's loss log) -> its count when last read
        self._last_prov: Any = None
        self.original: Any = None

    def install(self) -> None:
        self.original = torch.Tensor.backward
        follower = self

        def backward(tensor, *args, **kwargs):
            if tensor.numel() == 1 and not args and kwargs.get("gradient") is None and tensor.requires_grad:
                follower.on_backward(tensor)
            return follower.original(tensor, *args, **kwargs)

        backward.__wrapped__ = self.original  # type: ignore[attr-defined]
        backward.__doc__ = self.original.__doc__
        torch.Tensor.backward = backward

    def uninstall(self) -> None:
        if self.original is not None:
            torch.Tensor.backward = self.original

    def on_backward(self, tensor: Any) -> None:
        now = time.perf_counter()
        self.collect_provenance()
        amp = running.session()
        row: Dict[str, Any] = {"t": now, "session": id(amp) if amp is not None else None, "scale": None,
                               "steps": 0, "skipped_so_far": 0}
        scalers = amp.scaling.scalers if amp is not None else []
        if scalers:
            s = scalers[0]
            row.update(scale=float(s.scale), steps=int(s.steps), skipped_so_far=int(s.skipped))
        if len(self.rows) >= self.steps:
            self.end = row
            raise StopRun()
        value = None
        if amp is not None:
            log = losses.peek(amp.diagnostics)
            if log is not None and log.count != self._seen_log.get(id(log), 0):
                self._seen_log[id(log)] = log.count
                value = log.last()  # the true loss amp_patch recorded for this backward
        if value is None:
            with torch.no_grad():
                value = tensor.detach().float().reshape(()).clone()
        self.values.append(value)
        self.rows.append(row)

    def collect_provenance(self) -> None:
        amp = running.session()
        prov = last_overflow(amp.diagnostics) if amp is not None else None
        if prov is None and amp is None and running.last_ended() is not None:
            prov = running.last_ended().report.overflow
        if prov is not None and prov is not self._last_prov:
            self._last_prov = prov
            self.provenances.append(prov)


def _force_level(level: str, half: Optional[str], calls: List[Dict[str, Any]], find_overflow: bool) -> None:
    """Every ``initialize`` of the run (the launcher's and the script's own) at
    ``level``: the script's call keeps its models, optimizers and other
    options, and gets this level's opt level and half dtype (and, for a rerun
    that names the op, overflow provenance at every step)."""
    start = frontend._start

    def forced(models, optimizers, *, opt_level, half_dtype, lists, verbosity, options, apex_rules):
        opts = dict(options)
        site = _script_site()
        dropped = sorted(k for k in LEVEL_OPTIONS if opts.pop(k, None) is not None)
        if level == "O0" and opts.pop("loss_scale", None) is not None:
            dropped.append("loss_scale")
        if find_overflow:
            opts["find_overflow"] = True
        if site is not None:
            calls.append({"asked": str(opt_level), "dropped": dropped, "site": site})
        # the level's half dtype, the machine's when None (the script's own names one level's)
        return start(models, optimizers, opt_level=level, half_dtype=half, lists=lists, verbosity=verbosity,
                     options=opts, apex_rules=apex_rules)

    frontend._start = forced


def _script_site() -> Optional[str]:
    """``file:line`` of the script's line that called initialize, or None
    when the launcher called it (a launcher frame comes before any frame outside amp_patch)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path == os.path.join(here, "frontends", "launcher.py"):
            return None
        if not path.startswith(here + os.sep):
            return f"{os.path.basename(path)}:{f.f_lineno}"
        f = f.f_back
    return None


def child(spec_path: Optional[str] = None) -> int:
    """Run one level of a comparison (``spec_path``: a JSON written by the parent);
    writes the results to the spec's ``out`` path. The exit code is 0 when the
    script ran (to its end or to the step limit), 1 when it raised."""
    spec_path = spec_path or sys.argv[1]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    level, half = spec["opt_level"], spec.get("half_dtype")
    _seed(int(spec["seed"]))
    follower = _Follower(int(spec["steps"]))
    calls: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {"ended": "end", "error": None}
    follower.install()
    _force_level(level, half, calls, bool(spec.get("find_overflow")))
    started = time.perf_counter()
    launcher.last_no_run = None
    try:
        settings = launcher.Settings.resolve(opt_level=level, half_dtype=half, lists=spec.get("lists") or ())
        launcher.run(spec["script"], spec["args"], settings, stream=sys.stderr if spec.get("verbose") else None)
    except StopRun:
        result["ended"] = "steps"
    except SystemExit as e:
        code = e.code
        if code not in (None, 0):
            result["ended"] = "error"
            result["error"] = f"the script exited with code {code}"
    except BaseException as e:  # the script's own error: the parent says so, with the log
        traceback.print_exc()
        result["ended"] = "error"
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        follower.uninstall()
    ended_at = time.perf_counter()
    follower.collect_provenance()
    result.update(_child_figures(follower, ended_at, started, calls))
    result["no_run"] = launcher.last_no_run
    if launcher.last_no_run is not None:
        # e.g. the launcher stepped aside (the script runs its own mixed precision):
        # a session it had started ended unused, and the script ran as written
        result["opt_level"], result["half_dtype"] = "O0", "float32"
    with open(spec["out"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 1 if result["ended"] == "error" else 0


def _child_figures(follower: _Follower, ended_at: float, started: float, calls: List[Dict[str, Any]]) -> Dict[str, Any]:
    values: List[float] = []
    if follower.values:
        with torch.no_grad():
            values = [float(v) for v in torch.stack([v.detach().float().cpu().reshape(()) for v in follower.values]).tolist()]
    rows = follower.rows
    last = running.last_ended()
    c = last.counters if last is not None else None
    final_skipped = int(c["losses"][0]["skipped"]) if c and c.get("losses") else 0
    out_rows = []
    for i, r in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else follower.end
        if nxt is not None and nxt["session"] == r["session"]:
            skipped = nxt["skipped_so_far"] - r["skipped_so_far"]
            step_time: Optional[float] = nxt["t"] - r["t"]
        else:
            # the last backward of a session: its step was skipped if the session's count grew after it
            skipped = (final_skipped - r["skipped_so_far"]) if (i == len(rows) - 1 and r["session"] is not None) else 0
            step_time = None
        out_rows.append({"loss": values[i], "skipped": int(skipped > 0), "loss_scale": r["scale"], "step_time_s": step_time})
    provs = [_prov_dict(p) for p in follower.provenances]
    rep = last.report if last is not None else None
    return {
        "rows": out_rows, "provenance": provs, "calls": calls, "wall_s": ended_at - started,
        "opt_level": rep.opt_level if rep is not None else "O0",
        "half_dtype": rep.half_dtype if rep is not None and rep.opt_level != "O0" else "float32",
    }


def _prov_dict(p: Any) -> Dict[str, Any]:
    d = p.to_dict() if hasattr(p, "to_dict") else dict(vars(p))
    d["yaml"] = getattr(p, "yaml", None)
    d["text"] = str(p)
    return d


# =========================================================== the parent side


@dataclasses.dataclass
class LevelRun:
    """What one level's process reported."""

    name: str
    opt_level: str
    half_dtype: str
    rows: List[Dict[str, Any]]
    ended: str  # "steps" (stopped at --steps), "end" (the script ended), "error"
    error: Optional[str]
    wall_s: float
    log: str
    calls: List[Dict[str, Any]]
    provenance: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    no_run: Optional[str] = None  # why that process ran no mixed precision (the launcher's reason)

    @property
    def losses(self) -> List[float]:
        return [r["loss"] for r in self.rows]

    @property
    def fell_back(self) -> Optional[str]:
        """Why a mixed-precision level ran in FP32 (the launcher's reason), or None."""
        return None if LEVELS[self.name][0] == "O0" else self.no_run


@dataclasses.dataclass
class Verdict:
    """What compare says about one level against the reference."""

    final: Optional[float]  # mean loss over the last window of steps
    gap: Optional[float]  # final - reference final
    rel_gap: Optional[float]
    skipped: int
    step_time: Optional[float]  # median seconds per backward, after the warm-up
    speedup: Optional[float]
    diverged_at: Optional[int]
    diverged_why: Optional[str]
    departed_at: Optional[int]
    departed: Optional[Tuple[float, float]]  # (level's, reference's) smoothed losses there


def _window(n: int) -> int:
    return max(1, min(10, n // 10))


def smooth(values: Sequence[float], width: int) -> List[float]:
    """Trailing mean over ``width`` values (NaN where the window holds a non-finite value)."""
    out = []
    for i in range(len(values)):
        w = values[max(0, i - width + 1):i + 1]
        out.append(sum(w) / len(w) if all(math.isfinite(v) for v in w) else float("nan"))
    return out


def divergence(run: LevelRun, ref: Optional[LevelRun]) -> Tuple[Optional[int], Optional[str]]:
    """(the step, the reason) where ``run`` diverged, or (None, None).

    Diverged: a loss that is inf or NaN; or every step skipped from some step
    on, for at least 5 steps to the end of the run; or a final loss above the
    first one while the reference's final loss is below its first.
    """
    losses = run.losses
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            return i, f"its loss is {v} there"
    skipped = [r["skipped"] for r in run.rows]
    tail = 0
    for s in reversed(skipped):
        if not s:
            break
        tail += 1
    if tail >= 5:
        start = len(skipped) - tail
        if start == 0:
            return 0, f"every step ({tail}) was skipped for inf/NaN gradients: nothing trained"
        return start, f"every step from there to the end ({tail}) was skipped for inf/NaN gradients"
    w = _window(len(losses))
    if ref is not None and len(losses) >= 2 * w and len(ref.losses) >= 2 * w:
        first, last = statistics.fmean(losses[:w]), statistics.fmean(losses[-w:])
        rfirst, rlast = statistics.fmean(ref.losses[:w]), statistics.fmean(ref.losses[-w:])
        if last > first and rlast < rfirst:
            return len(losses) - w, f"its loss rose from {first:.4g} to {last:.4g} while {ref.name}'s fell from {rfirst:.4g} to {rlast:.4g}"
    return None, None


def departure(run: LevelRun, ref: LevelRun, threshold: float) -> Tuple[Optional[int], Optional[Tuple[float, float]]]:
    """The first step where the smoothed loss of ``run`` is more than
    ``threshold`` (relative) away from the reference's, and the two values there."""
    n = min(len(run.losses), len(ref.losses))
    w = max(1, min(5, n // 20))
    a, b = smooth(run.losses[:n], w), smooth(ref.losses[:n], w)
    for i in range(n):
        if not math.isfinite(a[i]) and math.isfinite(b[i]):
            return i, (a[i], b[i])
        if math.isfinite(a[i]) and math.isfinite(b[i]) and abs(a[i] - b[i]) > threshold * max(abs(b[i]), 1e-12):
            return i, (a[i], b[i])
    return None, None


def _median_step(run: LevelRun) -> Optional[float]:
    times = [r["step_time_s"] for r in run.rows if r.get("step_time_s") is not None]
    warm = min(5, len(times) // 5)
    times = times[warm:]
    return statistics.median(times) if times else None


def judge(run: LevelRun, ref: Optional[LevelRun], threshold: float) -> Verdict:
    losses = run.losses
    w = _window(len(losses))
    tail = losses[-w:]
    final = statistics.fmean(tail) if tail and all(math.isfinite(v) for v in tail) else (float("nan") if tail else None)
    ref_final = None
    if ref is not None and ref.losses:
        rt = ref.losses[-_window(len(ref.losses)):]
        ref_final = statistics.fmean(rt) if all(math.isfinite(v) for v in rt) else float("nan")
    gap = rel = None
    if final is not None and ref_final is not None and run is not ref:
        gap = final - ref_final
        rel = gap / abs(ref_final) if ref_final not in (0.0,) and math.isfinite(ref_final) else None
    st = _median_step(run)
    rst = _median_step(ref) if ref is not None else None
    speed = rst / st if st and rst and not run.fell_back else None  # FP32 against FP32 would be noise
    at, why = divergence(run, ref if ref is not run else None)
    dep_at, dep = (None, None)
    if ref is not None and run is not ref:
        dep_at, dep = departure(run, ref, threshold)
    return Verdict(final, gap, rel, sum(r["skipped"] for r in run.rows), st, speed, at, why, dep_at, dep)


def _needs_provenance(run: LevelRun, v: Verdict) -> Optional[int]:
    """The backward up to which a rerun with overflow provenance should watch, or None."""
    if run.opt_level == "O0" or not run.rows:
        return None
    skipped = [r["skipped"] for r in run.rows]
    first_clean = next((i for i, s in enumerate(skipped) if not s), len(skipped))
    later = [i for i, s in enumerate(skipped) if s and i > first_clean]  # after the initial scale search
    bad = [i for i, r in enumerate(run.rows) if not math.isfinite(r["loss"])]
    if v.diverged_at is None and len(later) <= max(2, len(skipped) // 20):
        return None
    candidates = [i for i in (bad[:1] + later[:1]) if i is not None]
    if v.diverged_at is not None:
        candidates.append(v.diverged_at)
    return min(candidates) + 2 if candidates else None


# ------------------------------------------------------------------ running


@dataclasses.dataclass
class Options:
    script: str
    args: List[str]
    levels: List[str]
    steps: int = 100
    seed: int = 0
    half_dtype: Optional[str] = None
    threshold: float = 0.1
    out: str = "amp_patch_compare"
    timeout: float = DEFAULT_TIMEOUT
    find_overflow: str = "auto"
    reference: str = "FP32"
    verbose: bool = False
    lists: List[str] = dataclasses.field(default_factory=list)


def run_level(opts: Options, name: str, find_overflow: bool = False, steps: Optional[int] = None,
              log_name: Optional[str] = None) -> LevelRun:
    """Run the script at one level in a process of its own; what it reported."""
    opt_level, half = LEVELS[name]
    if opt_level in ("O1", "O2", "O3") and opts.half_dtype is not None:
        half = opts.half_dtype
    os.makedirs(opts.out, exist_ok=True)
    log_path = os.path.join(opts.out, (log_name or name) + ".log")
    with tempfile.TemporaryDirectory(prefix="amp_patch_compare_") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        spec = {"script": opts.script, "args": opts.args, "opt_level": opt_level, "half_dtype": half, "seed": opts.seed,
                "steps": steps if steps is not None else opts.steps, "out": out_path, "find_overflow": find_overflow,
                "verbose": opts.verbose, "lists": [os.path.abspath(x) for x in opts.lists]}
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONHASHSEED=str(opts.seed))
        cmd = [sys.executable, "-c", "import sys; from amp_patch.frontends.compare import child; sys.exit(child(sys.argv[1]))",
               spec_path]
        started = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=opts.timeout)
                rc: Optional[int] = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        wall = time.perf_counter() - started
        if rc is None:
            return LevelRun(name, opt_level, half or "", [], "error", f"it ran past --timeout {opts.timeout:g} s and was stopped",
                            wall, log_path, [])
        try:
            with open(out_path, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, ValueError):
            return LevelRun(name, opt_level, half or "", [], "error",
                            f"its process ended (exit code {rc}) before it reported; see {log_path}", wall, log_path, [])
    return LevelRun(name, got["opt_level"], got["half_dtype"], got["rows"], got["ended"], got["error"], got["wall_s"],
                    log_path, got["calls"], got["provenance"], got.get("no_run"))


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


def _fmt(x: Optional[float], spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _precision(run: LevelRun) -> str:
    if run.fell_back:
        return "float32 (no AMP ran)"
    if run.opt_level == "O0":
        return "float32"
    scales = [r["loss_scale"] for r in run.rows if r["loss_scale"] is not None]
    dynamic = len(set(scales)) > 1 or (scales and scales[0] != 1.0)
    return f"{run.half_dtype}" + (", loss scaled" if dynamic else "")


def table(runs: List[LevelRun], verdicts: Dict[str, Verdict], ref: Optional[LevelRun]) -> str:
    head = ("level", "precision", "steps", "final loss", f"vs {ref.name}" if ref else "vs ref", "skipped", "step time", "speedup")
    body = []
    for r in runs:
        v = verdicts[r.name]
        if r is ref:
            vs = "-"
        elif v.gap is None:
            vs = "-"
        elif not math.isfinite(v.gap):
            vs = "not finite"
        else:
            vs = f"{v.gap:+.3g}" + (f" ({100 * v.rel_gap:+.1f}%)" if v.rel_gap is not None else "")
        body.append((r.name, _precision(r), str(len(r.rows)), _fmt(v.final), vs, str(v.skipped),
                     "-" if v.step_time is None else f"{1000 * v.step_time:.1f} ms",
                     "-" if v.speedup is None else f"{v.speedup:.2f}x"))
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    right = {2, 3, 5, 6, 7}
    fmt = lambda row: "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(b) for b in body])


def _prov_sentence(provs: List[Dict[str, Any]]) -> Optional[str]:
    """What the overflow provenance named: the first event that is not the loss
    scale at work, else the first one."""
    found = [p for p in provs if p.get("kind")]
    if not found:
        return None
    real = [p for p in found if p["kind"] != "cast_gradient"]
    p = (real or found)[0]
    where = f" in module '{p['module']}' ({p['module_type']})" if p.get("module") else ""
    kind = {"output": "its output", "cast": "amp_patch's cast of an input to it", "gradient": "its gradient",
            "cast_gradient": "a gradient cast back to the half dtype (the loss scale at work)"}.get(p["kind"], p["kind"])
    fin = "" if p.get("inputs_finite") is None else (", from finite inputs" if p["inputs_finite"] else ", from inputs already inf/NaN")
    text = f"the overflow provenance names {p.get('op') or 'a module output'}{where}: {kind} held inf/NaN in {p.get('dtype')}{fin}"
    if p.get("step") is not None:
        text += f" (step {p['step']})"
    if p.get("yaml"):
        text += "; to run it in float32, an op-list override (--lists FILE.yaml):\n      " + p["yaml"].rstrip().replace("\n", "\n      ")
    return text


def messages(runs: List[LevelRun], verdicts: Dict[str, Verdict], ref: Optional[LevelRun], threshold: float) -> List[str]:
    out = []
    for r in runs:
        v = verdicts[r.name]
        if r is ref:
            continue
        parts = []
        if r.fell_back:
            parts.append(f"ran in FP32, not at {LEVELS[r.name][0]}: {r.fell_back}; its figures are FP32's")
        if v.diverged_at is not None:
            parts.append(f"DIVERGED at step {v.diverged_at}: {v.diverged_why}")
        if v.departed_at is not None and ref is not None:
            a, b = v.departed
            if math.isfinite(a):
                parts.append(f"first departed from {ref.name} by more than {100 * threshold:g}% at step {v.departed_at} "
                             f"(smoothed loss {a:.4g} against {b:.4g}, {100 * (a - b) / abs(b):+.1f}%)")
            else:
                parts.append(f"first departed from {ref.name} at step {v.departed_at} (its loss turned inf/NaN; {ref.name}'s {b:.4g})")
        elif ref is not None and v.diverged_at is None and r.rows and not r.fell_back:
            parts.append(f"stayed within {100 * threshold:g}% of {ref.name}'s loss at every step")
        if v.rel_gap is not None and math.isfinite(v.rel_gap):
            parts.append(f"final loss {100 * v.rel_gap:+.2f}% against {ref.name}'s")
        first_clean = next((i for i, x in enumerate(r.rows) if not x["skipped"]), None)
        if v.skipped:
            parts.append(f"{v.skipped} step{'s' if v.skipped != 1 else ''} skipped"
                         + (f" ({first_clean} at the start, while the dynamic loss scale found its level)" if first_clean else ""))
        sentence = _prov_sentence(r.provenance)
        text = f"{r.name}: " + "; ".join(parts)
        if sentence:
            head, _, yaml = sentence.partition("\n")
            text += "; " + head + ("\n" + yaml if yaml else "")
        out.append(text if sentence and "\n" in sentence else text + ".")
    return out


def write_csv(path: str, runs: List[LevelRun]) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in runs:
            for i, row in enumerate(r.rows):
                w.writerow([r.name, r.opt_level, r.half_dtype, i, repr(float(row["loss"])), row["skipped"],
                            "" if row["loss_scale"] is None else f"{row['loss_scale']:g}",
                            "" if row["step_time_s"] is None else f"{row['step_time_s']:.6f}"])
    return path


COLOURS = {"FP32": "black", "O0": "black", "O1": "tab:blue", "O2": "tab:orange", "O3": "tab:red", "O4": "tab:green", "O5": "tab:purple"}


def write_png(path: str, runs: List[LevelRun], ref: Optional[LevelRun], threshold: float, script: str) -> Optional[str]:
    """The loss per level, its gap to the reference (smoothed), and the loss scale; None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(15, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_gap, ax_scale = fig.subplots(1, 3)
    finite = [v for r in runs for v in r.losses if math.isfinite(v)]
    top = max(finite) if finite else 1.0
    for r in runs:
        colour = COLOURS.get(r.name)
        steps = list(range(len(r.rows)))
        ok = [(i, v) for i, v in zip(steps, r.losses) if math.isfinite(v)]
        label = f"{r.name} ({_precision(r)})"
        if ok:
            ax_loss.plot(*zip(*ok), color=colour, lw=1.5 if r is ref else 1.0, label=label)
        bad = [i for i, v in zip(steps, r.losses) if not math.isfinite(v)]
        if bad:
            ax_loss.plot(bad, [top] * len(bad), "^", color=colour or "red", ms=4, label=f"{r.name}: inf/NaN loss")
        sk = [(i, v) for i, (v, row) in enumerate(zip(r.losses, r.rows)) if row["skipped"] and math.isfinite(v)]
        if sk:
            ax_loss.plot(*zip(*sk), "x", color=colour, ms=4)
        if ref is not None and r is not ref:
            n = min(len(r.losses), len(ref.losses))
            w = max(1, min(5, n // 20))
            a, b = smooth(r.losses[:n], w), smooth(ref.losses[:n], w)
            gaps = [(i, 100 * (x - y) / abs(y)) for i, (x, y) in enumerate(zip(a, b)) if math.isfinite(x) and math.isfinite(y) and y]
            if gaps:
                ax_gap.plot(*zip(*gaps), color=colour, label=r.name)
        scales = [(i, row["loss_scale"]) for i, row in enumerate(r.rows) if row["loss_scale"] is not None]
        if scales:
            ax_scale.step(*zip(*scales), where="post", color=colour, label=r.name)
            skipped = [(i, row["loss_scale"]) for i, row in enumerate(r.rows) if row["skipped"] and row["loss_scale"] is not None]
            if skipped:
                ax_scale.plot(*zip(*skipped), "x", color=colour)
    if finite and min(finite) > 0 and max(finite) / min(finite) > 50:
        ax_loss.set_yscale("log")
    ax_loss.set_title(f"loss ({os.path.basename(script)}; x: step skipped)")
    ax_loss.set_xlabel("step")
    ax_loss.legend(fontsize="small")
    if ref is not None:
        for y in (100 * threshold, -100 * threshold):
            ax_gap.axhline(y, color="grey", ls=":", lw=1)
        ax_gap.axhline(0, color=COLOURS.get(ref.name, "black"), lw=1)
        ax_gap.set_title(f"loss gap to {ref.name}, % (smoothed; dotted: ±{100 * threshold:g}%)")
        if ax_gap.lines[3:]:
            ax_gap.legend(fontsize="small")
    ax_gap.set_xlabel("step")
    ax_scale.set_title("loss scale (x: step skipped)")
    ax_scale.set_xlabel("step")
    if any(row["loss_scale"] not in (None, 1.0) for r in runs for row in r.rows):
        ax_scale.set_yscale("log", base=2)
    if ax_scale.lines:
        ax_scale.legend(fontsize="small")
    else:
        ax_scale.text(0.5, 0.5, "no level scaled its loss", ha="center", va="center", transform=ax_scale.transAxes)
    fig.savefig(path, format="png", dpi=80)
    return path


class UsageExit(Exception):
    """A usage error or ``--help``: the exit code, returned by ``main`` (not SystemExit),
    so that under ``amp-patch run`` only the script's own SystemExit leaves ``main``."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class SuggestingParser(argparse.ArgumentParser):
    """argparse that names the nearest valid option for a misspelled one
    (``--opt-lvl``: did you mean ``--opt-level``?), its own or, after a
    subcommand, the subcommand's; the demo's parser is one."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self.suggestion(extras, ns)}")
        return ns

    def option_names(self, ns: Optional[argparse.Namespace] = None) -> List[str]:
        """This parser's option strings and, where ``ns`` chose a subcommand, that subcommand's."""
        names = [s for a in self._actions for s in a.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and ns is not None:
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if sub is not None:
                    names += [s for a in sub._actions for s in a.option_strings]
        return names

    def suggestion(self, extras: Sequence[str], ns: Optional[argparse.Namespace] = None) -> str:
        """`` (did you mean --opt-level?)`` for the unrecognized options that are near a valid one."""
        names = [n for n in self.option_names(ns) if n.startswith("--")]
        pairs = []
        for tok in extras:
            if not tok.startswith("--"):
                continue
            word = tok.split("=", 1)[0]
            near = difflib.get_close_matches(word, names, n=1, cutoff=0.75)
            if near:
                pairs.append((word, near[0]))
        if not pairs:
            return ""
        if len(pairs) == 1 and sum(tok.startswith("-") for tok in extras) == 1:
            return f" (did you mean {pairs[0][1]}?)"
        return " (did you mean " + ", ".join(f"{near} for {word}" for word, near in pairs) + "?)"


class Parser(SuggestingParser):
    """argparse whose exit raises ``UsageExit``: the CLI's parsers (``cli`` uses it too)."""

    def exit(self, status: int = 0, message: Optional[str] = None):
        if message:
            self._print_message(message, sys.stderr)
        raise UsageExit(status)


def split_script_args(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Split the tokens into ``parser``'s options and ``[script, *script args]``
    (by hand, so that the script's arguments, ``--`` and flags named like ours
    included, reach it exactly as typed); ``run`` splits its command line so too."""
    takes_value = {s for a in parser._actions for s in a.option_strings if a.nargs != 0}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            return list(tokens[:i]), list(tokens[i + 1:])
        if not tok.startswith("-") or tok == "-":
            return list(tokens[:i]), list(tokens[i:])
        i += 2 if tok in takes_value else 1  # "--steps 5" takes the next token, "--steps=5" is one
    return list(tokens), []


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG, usage=f"{PROG} [options] script.py [script args ...]",
        description="Run a training script unmodified at several opt levels, each in its own process with the same seed, "
        "and compare the loss step by step: a table, the curves (PNG) and the numbers (CSV). Everything after the "
        "script path is passed to the script.",
        allow_abbrev=False,
    )
    p.add_argument("--levels", default=",".join(DEFAULT_LEVELS),
                   help=f"comma-separated, of FP32 (= O0), O1..O5 (default {','.join(DEFAULT_LEVELS)}; O1-O3 in the machine's "
                   "half dtype: BF16 on a CPU, FP16 on a GPU, or --half-dtype)")
    p.add_argument("--steps", type=int, default=100, help="backwards to follow at each level; the script is stopped after them (default 100)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every level's process: torch, random, numpy, PYTHONHASHSEED (default 0)")
    p.add_argument("--half-dtype", metavar="float16|bfloat16", help="the half dtype of O1-O3 (default: the machine's)")
    p.add_argument("--lists", metavar="FILE.yaml", action="append", default=[],
                   help="op-list override for every level but FP32, as amp-patch run takes it; repeatable")
    p.add_argument("--threshold", type=float, default=0.1,
                   help="how far (relative) a level's smoothed loss may move from FP32's before compare says it departed (default 0.1)")
    p.add_argument("--out", default="amp_patch_compare", help="folder for compare.csv, compare.png and each level's log (default amp_patch_compare)")
    p.add_argument("--find-overflow", choices=("auto", "every-step", "off"), default="auto",
                   help="auto: rerun a level that diverged or kept skipping steps with overflow provenance armed, to name "
                   "the op; every-step: arm it in the timed runs too (slower steps); off: never")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds one level may run (default 3600)")
    p.add_argument("--verbose", action="store_true", help="the launcher's own lines in each level's log")
    return p


def parse(tokens: Sequence[str]) -> Options:
    """``compare``'s command line as ``Options``; a usage error raises ``UsageExit`` (code 2)."""
    p = _parser()
    options, rest = split_script_args(p, tokens)
    ns = p.parse_args(options)
    if not rest:
        p.error("the script to run is missing (usage: amp-patch compare [options] script.py [args ...])")
    names = [x.strip().upper() for x in ns.levels.split(",") if x.strip()]
    bad = [x for x in names if x not in LEVELS]
    if bad or not names:
        p.error(f"unknown level {', '.join(bad) or '(none given)'}: use FP32 (or O0), O1, O2, O3, O4, O5")
    if len(set(LEVELS[x] for x in names)) != len(names):
        p.error(f"--levels names a level twice: {ns.levels}")
    if ns.steps < 1:
        p.error("--steps must be at least 1")
    if ns.half_dtype is not None and ns.half_dtype.lower() not in ("float16", "bfloat16", "fp16", "bf16", "half"):
        p.error(f"--half-dtype {ns.half_dtype!r}: use float16 or bfloat16")
    half = None if ns.half_dtype is None else ("bfloat16" if ns.half_dtype.lower() in ("bfloat16", "bf16") else "float16")
    if not 0 < ns.threshold:
        p.error("--threshold must be above 0 (0.1 is 10%)")
    try:
        launcher.check_script(rest[0])
    except AmpError as e:
        p.error(str(e))
    missing = [f for f in ns.lists if not os.path.isfile(f)]
    if missing:
        p.error(f"--lists: no such file: {', '.join(missing)}")
    ref = "FP32" if "FP32" in names else ("O0" if "O0" in names else names[0])
    return Options(rest[0], list(rest[1:]), names, ns.steps, ns.seed, half, ns.threshold, ns.out, ns.timeout,
                   ns.find_overflow, ref, ns.verbose, list(ns.lists))


def compare(opts: Options, say=print) -> Tuple[int, List[LevelRun], Dict[str, Verdict]]:
    """Run every level, judge each against the reference, write the files, say what was found.

    Returns (exit code, the runs, the verdicts): 0 when every level ran and
    none diverged, 1 otherwise.
    """
    try:
        with open(opts.script, encoding="utf-8") as f:
            call = scan.initialize_call(f.read(), opts.script)
    except (OSError, UnicodeDecodeError, SyntaxError, IsADirectoryError):
        call = None
    say(f"{PROG}: {os.path.basename(opts.script)} at {', '.join(opts.levels)}, {opts.steps} steps each, seed {opts.seed}; "
        f"each level in its own process")
    if call is not None:
        say(f"  {os.path.basename(opts.script)}:{call[0]} calls {call[1]} itself: each level's opt level and half dtype "
            f"replace the ones it names there")
    runs: List[LevelRun] = []
    for name in opts.levels:
        r = run_level(opts, name, find_overflow=opts.find_overflow == "every-step")
        how = {"steps": "stopped after", "end": "the script ended after", "error": "FAILED after"}[r.ended]
        say(f"  {name:<5} {how} {len(r.rows)} step{'s' if len(r.rows) != 1 else ''} in {r.wall_s:.1f} s ({r.opt_level}, {r.half_dtype})")
        for c in r.calls:
            if c["dropped"]:
                say(f"        {c['site']}'s initialize (opt_level {c['asked']}) ran at {r.opt_level} without its "
                    f"{', '.join(c['dropped'])}")
        runs.append(r)
    rc = 0
    problems = []
    for r in runs:
        if r.ended == "error":
            rc = 1
            problems.append(f"{r.name}: the script failed: {r.error}; the end of {r.log}:\n{_tail(r.log)}")
        elif not r.rows:
            rc = 1
            problems.append(
                f"{r.name}: {os.path.basename(opts.script)} never called loss.backward() on a one-element loss "
                f"(it ran to its end in {r.wall_s:.1f} s). compare follows the loss through Tensor.backward; a script "
                f"that trains with torch.autograd.backward or torch.autograd.grad, or that trains nothing, gives it "
                f"nothing to compare. Its output is in {r.log}.")
    ok = [r for r in runs if r.rows]
    ref = next((r for r in ok if r.name == opts.reference), None)
    if ref is None and ok:
        ref = ok[0]
    verdicts = {r.name: judge(r, ref, opts.threshold) for r in runs}
    # name the op: a rerun with provenance armed, up to the first problem step
    if opts.find_overflow == "auto":
        for r in ok:
            until = _needs_provenance(r, verdicts[r.name])
            if until is None or r.provenance:
                continue
            say(f"  {r.name:<5} rerun with overflow provenance armed, to step {until}")
            again = run_level(opts, r.name, find_overflow=True, steps=until + 1, log_name=f"{r.name}.find_overflow")
            r.provenance = again.provenance
    if any(verdicts[r.name].diverged_at is not None for r in ok if r is not ref):
        rc = 1
    say("")
    if ok:
        say(table(ok, verdicts, ref))
        say("")
        for line in messages(ok, verdicts, ref, opts.threshold):
            say(line)
    for line in problems:
        say(line)
    if ok:
        os.makedirs(opts.out, exist_ok=True)
        csv_path = write_csv(os.path.join(opts.out, "compare.csv"), ok)
        png = write_png(os.path.join(opts.out, "compare.png"), ok, ref, opts.threshold, opts.script)
        say("")
        say(f"numbers: {csv_path}")
        say(f"curves:  {png}" if png else "curves:  not drawn: matplotlib is missing (pip install -e '.[plot]')")
        say(f"logs:    {os.path.join(opts.out, '<level>.log')}")
        speeds = [verdicts[r.name].speedup for r in ok if r is not ref and verdicts[r.name].speedup]
        if speeds and ref is not None:
            warm = min(5, len(ref.rows) // 5)
            say(f"(speedup: {ref.name}'s median time from one backward to the next over each level's, after "
                f"{warm} warm-up step{'s' if warm != 1 else ''}, on {_machine()}; levels one after another)")
    return rc, runs, verdicts


def _machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        name = importlib.import_module("amp_patch.frontends.demo").cpu_name()
    except (ImportError, AttributeError):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def main(tokens: Sequence[str]) -> int:
    """``amp-patch compare``'s entry point; returns the exit code (2: bad command line).

    Example::

        main(["--steps", "50", "--levels", "FP32,O1", "train.py", "--epochs", "1"])
    """
    try:
        opts = parse(tokens)
    except UsageExit as e:
        return e.code
    rc, _, _ = compare(opts)
    return rc
