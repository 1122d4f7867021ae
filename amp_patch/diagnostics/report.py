"""Reading what AMP did: ``report()``, ``reset_stats()`` and ``plot()``.

``report()`` gathers the op ledger (``collect_stats=True``), every loss
scaler's history of ``(step, scale, skipped)`` and the last overflow
provenance into one ``Report``: ``str()`` is a table for people,
``to_dict()`` the same for programs. ``plot(path)`` draws the loss of every
backward beside the loss-scale histories with matplotlib, the optional extra
``plot``.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import running
from ..base.errors import StateError
from ..patching import attention
from . import losses as loss_log
from .notices import warn_user
from .overflow import history_entry, last_overflow
from .stats import dtype_name

if TYPE_CHECKING:
    from .overflow import Provenance
    from .state import Diagnostics

POLICY_ORDER = ("half", "float", "promote", "sequence_promote")

History = List[Tuple[int, float, bool]]


def _current(what: str) -> "Diagnostics":
    """The running session's diagnostics; StateError when none runs."""
    amp = running.session()
    if amp is None:
        raise StateError(
            f"amp_patch.{what}() needs a running AMP: call it after amp_patch.initialize(...) "
            f"and before amp_patch.deinitialize()"
        )
    return amp.diagnostics




def read_history(scaler: object) -> Optional[History]:
    """A scaler's ``history`` as ``[(step, scale, skipped), ...]``, or None.

    Read defensively: entries of another shape are left out, and a scaler
    without a ``history`` gives None.
    """
    raw = getattr(scaler, "history", None)
    if raw is None:
        return None
    return [e for e in map(history_entry, list(raw)) if e is not None]


def _scalers(scalers: Sequence[object]) -> List[Tuple[int, History, Optional[float]]]:
    """``(loss_id, history, current scale or None)`` for every loss scaler."""
    out = []
    for i, scaler in enumerate(scalers):
        loss_id = getattr(scaler, "loss_id", i)
        scale = getattr(scaler, "scale", None)
        scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        out.append((loss_id if isinstance(loss_id, int) else i, read_history(scaler) or [], scale))
    return out


def _scale_summary(loss_id: int, rows: History, now: Optional[float]) -> Dict[str, Any]:
    # the scale each step ran with, and the one the next step will use
    scales = [s for _, s, _ in rows] + ([now] if now is not None and rows else [])
    skipped = [step for step, _, sk in rows if sk]
    return {
        "loss_id": loss_id,
        "steps": len(rows),
        "skipped": len(skipped),
        "skipped_steps": skipped,
        "scale": now if now is not None else (scales[-1] if scales else None),
        "min_scale": min(scales) if scales else None,
        "max_scale": max(scales) if scales else None,
        "history": [list(r) for r in rows],
    }


class Report:
    """What one AMP run did, as a table (``str()``) or a dict (``to_dict()``).

    Attributes:
        opt_level, half_dtype, device: the run's settings.
        ops: ``{qualname: {policy, calls, dtypes, casts, bytes_cast,
            first_call_site, kept_fp32, kept_why}}``, empty unless
            ``collect_stats=True``; ``kept_fp32`` counts the calls
            ``cast_policy="auto"`` ran in FP32, ``kept_why`` says why.
        unlisted: ``{qualname: {calls, first_call_site}}``: ops no list covers
            that ran in FP32 on inputs that could have been half.
        utilities: ``{utility: {calls, ops, first_call_site}}``: the patched ops
            torch's gradient and parameter utilities ran when the script called
            them (``torch.nn.utils.clip_grad_norm_``: its ``stack``, ``__mul__``,
            ...), counted under the utility, not in ``ops``: they are not the
            model's ops. ``calls`` counts their op calls, ``ops`` each op's.
        loss_scale: one summary per loss scaler, with its history.
        overflow: the last overflow provenance (``find_overflow``), or None.
        attention: under ``cast_policy="auto"`` (O2/O5's default): one dict per
            attention shape class measured in this process, with the dtype its
            calls run in and the two timings (``patching.attention``).
        losses: ``(loss_id, step, loss)`` of every backward amp_patch scaled
            (a plain ``loss.backward()`` or a ``scale_loss`` block), the true
            loss, newest 10,000; empty where ``Tensor.backward`` is not patched
            (O0, O3 at a static scale of 1).
        fp8: at O6/O7, one dict per ``nn.Linear`` of the models: ``layer``,
            ``shape`` (out, in), ``runs_in`` (``"float8"`` or the model's
            dtype), ``recipe``, ``why`` it stays out of FP8, and ``calls`` (its
            forwards, counted under ``collect_stats=True``, else None);
            ``precision.fp8``.
    """

    def __init__(self, opt_level: str, half_dtype: str, device: str, collecting: bool,
                 ledger: Dict[str, Any], loss_scale: List[Dict[str, Any]], overflow: Optional[Provenance],
                 attention: Optional[List[Dict[str, Any]]] = None, losses: "Optional[loss_log.LossLog]" = None,
                 fp8: Optional[List[Dict[str, Any]]] = None):
        self.opt_level = opt_level
        self.half_dtype = half_dtype
        self.device = device
        self.collecting = collecting
        self.ops: Dict[str, Dict[str, Any]] = ledger.get("ops", {})
        self.unlisted: Dict[str, Dict[str, Any]] = ledger.get("unlisted", {})
        self.utilities: Dict[str, Dict[str, Any]] = ledger.get("utilities", {})
        self.loss_scale = loss_scale
        self.overflow = overflow
        self.attention: List[Dict[str, Any]] = attention or []
        self._losses = losses  # read on the host only when asked: no sync at deinitialize
        self.fp8: List[Dict[str, Any]] = fp8 or []

    @property
    def losses(self) -> List[Tuple[int, int, float]]:
        """``(loss_id, step, loss)`` of every backward recorded, oldest first."""
        return self._losses.rows() if self._losses is not None else []

    def to_dict(self) -> Dict[str, Any]:
        """Everything in the report as plain Python values (JSON-ready)."""
        return {
            "opt_level": self.opt_level,
            "half_dtype": self.half_dtype,
            "device": self.device,
            "collect_stats": self.collecting,
            "ops": self.ops,
            "unlisted": self.unlisted,
            "utilities": self.utilities,
            "loss_scale": self.loss_scale,
            "overflow": None if self.overflow is None else self.overflow.to_dict(),
            "attention": self.attention,
            "losses": [list(r) for r in self.losses],
            "fp8": self.fp8,
        }

    def __str__(self) -> str:
        lines = [f"amp_patch report: {self.opt_level}, half dtype {self.half_dtype}, {self.device}"]
        lines += self._ops_lines()
        lines += self._fp8_lines()
        lines += self._attention_lines()
        lines += self._scale_lines()
        lines += self._loss_lines()
        if self.overflow is not None:
            lines.append("last overflow:")
            lines += ["  " + line for line in str(self.overflow).splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        calls = sum(o["calls"] for o in self.ops.values())
        return f"<amp_patch Report {self.opt_level} {self.half_dtype}: {len(self.ops)} ops, {calls} calls>"

    def _ops_lines(self) -> List[str]:
        if not self.collecting:
            return ["ops: not recorded; initialize(..., collect_stats=True) records them"]
        total = sum(o["calls"] for o in self.ops.values())
        lines = [f"ops: {len(self.ops)} patched ops, {total} calls"]
        groups: Dict[str, List[Tuple[str, Dict[str, Any]]]] = {}
        for q, o in self.ops.items():
            groups.setdefault(o["policy"], []).append((q, o))
        order = [p for p in POLICY_ORDER if p in groups] + sorted(p for p in groups if p not in POLICY_ORDER)
        head = ("op", "calls", "ran in", "casts", "bytes cast", "first call site")
        body: List[Tuple[str, ...]] = []
        for policy in order:
            body.append((f"policy {policy}:",))
            for q, o in sorted(groups[policy], key=lambda qo: (-qo[1]["calls"], qo[0])):
                body.append((
                    "  " + q, str(o["calls"]), _dtypes_text(o["dtypes"]), str(o["casts"]),
                    _bytes_text(o["bytes_cast"]), _site_text(o["first_call_site"]),
                ))
        lines += ["  " + r for r in _table(head, body, right=(1, 3, 4))]
        kept = sorted((q, o) for q, o in self.ops.items() if o.get("kept_fp32"))
        if kept:
            lines.append("kept in float32 by cast_policy='auto' (the half dtype does not win there):")
            body = [(q, f"{o['kept_fp32']} of {o['calls']}", f"e.g. {o['kept_why']}") for q, o in kept]
            lines += ["  " + r for r in _table(("op", "calls", "why"), body, right=(1,))]
        if self.utilities:
            lines.append("ops inside torch's utilities (their own arithmetic on your parameters and gradients; "
                         "not your model's ops, so not in the table above):")
            rows = sorted(self.utilities.items(), key=lambda uo: (-uo[1]["calls"], uo[0]))
            body = [(u, str(o["calls"]), ", ".join(f"{q.partition('torch.')[2] or q} {n}" for q, n in
                                                    sorted(o["ops"].items(), key=lambda qn: (-qn[1], qn[0]))),
                     _site_text(o["first_call_site"])) for u, o in rows]
            lines += ["  " + r for r in _table(("utility", "op calls", "ops", "first call site"), body, right=(1,))]
        if self.unlisted:
            lines.append(
                f"unlisted ops seen (ran in float32 on inputs that could be {self.half_dtype}; "
                f"no list covers them, a YAML override can):"
            )
            rows = sorted(self.unlisted.items(), key=lambda qo: (-qo[1]["calls"], qo[0]))
            body = [(q, str(o["calls"]), _site_text(o["first_call_site"])) for q, o in rows]
            lines += ["  " + r for r in _table(("op", "calls", "first call site"), body, right=(1,))]
        else:
            lines.append("unlisted ops seen: none")
        return lines

    def _fp8_lines(self) -> List[str]:
        if not self.fp8:
            return []
        n = sum(r["runs_in"] == "float8" for r in self.fp8)
        recipe = next((r["recipe"] for r in self.fp8 if r["recipe"]), None)
        lines = [f"FP8 layers: {n} of {len(self.fp8)} nn.Linear layers compute in float8"
                 + (f" (torchao, {recipe} recipe)" if recipe else "")]
        counted = any(r["calls"] is not None for r in self.fp8)
        body = []
        for r in self.fp8:
            layer = r["layer"] if not r["model"] else f"model{r['model']}.{r['layer']}"
            calls = "" if r["calls"] is None else str(r["calls"])
            body.append((layer, f"{r['shape'][0]} x {r['shape'][1]}", r["runs_in"]) + ((calls,) if counted else ())
                        + (r["why"],))
        head = ("layer", "out x in", "runs in") + (("calls",) if counted else ()) + ("why not float8",)
        lines += ["  " + row for row in _table(head, body, right=(3,) if counted else ())]
        return lines

    def _attention_lines(self) -> List[str]:
        if not self.attention:
            return []
        lines = ["attention, measured once per shape class (cast_policy='auto'):"]
        body = []
        for a in self.attention:
            shape = f"{a['query_len']} x {a['key_len']}, head {a['head_size']}" + (", causal" if a["causal"] else "") + (
                ", masked" if a["masked"] else "")
            if a["runs_in"] is None:
                body.append((shape, a["dtype"], "float32 kernel refused it", ""))
            elif a["half_ms"] is None:
                body.append((shape, a["runs_in"], "from the checkpoint", ""))
            else:
                body.append((shape, a["runs_in"], f"{a['half_ms']:.2f} ms in {a['dtype']}", f"{a['fp32_ms']:.2f} ms in float32"))
        lines += ["  " + r for r in _table(("shape class", "runs in", "half (forward+backward)", "float32"), body)]
        return lines

    def _scale_lines(self) -> List[str]:
        if not self.loss_scale:
            return ["loss scale: no scaler"]
        lines = ["loss scale:"]
        for s in self.loss_scale:
            if not s["steps"]:
                lines.append(f"  loss {s['loss_id']}: no steps recorded; scale {_num(s['scale'])}")
                continue
            skipped = s["skipped_steps"]
            where = ""
            if skipped:
                shown = ", ".join(str(x) for x in skipped[:8]) + (", ..." if len(skipped) > 8 else "")
                where = f" (step {shown})"
            static = " (static: no loss scaling, bfloat16 needs none)" if (
                s["min_scale"] == s["max_scale"] == 1.0 and self.half_dtype == "bfloat16") else ""
            lines.append(
                f"  loss {s['loss_id']}: {s['steps']} steps, {s['skipped']} skipped{where}; "
                f"scale {_num(s['scale'])} now (min {_num(s['min_scale'])}, max {_num(s['max_scale'])}){static}"
            )
        return lines


    def _loss_lines(self) -> List[str]:
        if not self.losses:
            return []
        lines = ["loss (the true loss of each backward):"]
        for lid in sorted({r[0] for r in self.losses}):
            vals = [(step, v) for i, step, v in self.losses if i == lid]
            finite = [v for _, v in vals if math.isfinite(v)]
            bad = [step for step, v in vals if not math.isfinite(v)]
            low = f", min {min(finite):.4g}" if finite else ""
            lines.append(f"  loss {lid}: {len(vals)} backwards, first {vals[0][1]:.4g}, last {vals[-1][1]:.4g}{low}"
                         + (f"; {len(bad)} not finite (the first at step {bad[0]})" if bad else ""))
        return lines


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else f"{x:g}"


def _dtypes_text(dtypes: Dict[str, int]) -> str:
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return ", ".join(f"{k} ({v})" for k, v in sorted(dtypes.items(), key=lambda kv: -kv[1]))


def _bytes_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _site_text(site: str) -> str:
    path, sep, line = site.rpartition(":")
    if not sep:
        return site
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        rel = path
    return f"{rel if not rel.startswith('..') else path}:{line}"


def _table(head: Tuple[str, ...], rows: List[Tuple[str, ...]], right: Tuple[int, ...] = ()) -> List[str]:
    """Aligned columns; a one-cell row is a group title and spans the table."""
    full = [r for r in [head, *rows] if len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]

    def fmt(r: Tuple[str, ...]) -> str:
        if len(r) != len(head):
            return r[0]
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(head)] + [fmt(r) for r in rows]


def report() -> Report:
    """What the running AMP did: per-op ledger, loss-scale history, overflows.

    The op table needs ``initialize(..., collect_stats=True)``; the loss-scale
    summary and the last overflow provenance are always there. After
    ``deinitialize`` it is the last run's report, as that run ended.

    Returns:
        a ``Report``: ``print()`` it for a table (ops grouped by policy, most
        called first; unlisted ops seen; loss scale per loss), or call
        ``.to_dict()`` for plain values.

    Raises:
        StateError: no run has started yet.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1", collect_stats=True)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        print(amp_patch.report())
        calls = amp_patch.report().to_dict()["ops"]["torch.nn.functional.linear"]["calls"]
    """
    amp = running.session()
    if amp is not None:
        return report_of(amp.diagnostics)
    last = running.last_ended()
    if last is None:
        raise StateError("amp_patch.report() has no run to report on yet: call it after amp_patch.initialize(...)")
    return last.report


def report_of(diag: "Diagnostics") -> Report:
    """``report()`` of the session whose diagnostics are ``diag``."""
    ledger = diag.ledger.to_dict() if diag.ledger is not None else {}
    props = diag.config
    return Report(
        opt_level=props.opt_level,
        half_dtype=dtype_name(props.half_dtype),
        device=diag.device_type,
        collecting=diag.ledger is not None,
        ledger=ledger,
        loss_scale=[_scale_summary(*s) for s in _scalers(diag.scalers())],
        overflow=last_overflow(diag),
        attention=[{k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in row.items()}
                   for row in attention.decisions()] if props.cast_policy == "auto" else [],
        losses=loss_log.peek(diag),
        fp8=diag.fp8_rows(),
    )


def reset_stats() -> None:
    """Clear the op ledger (calls, casts, unlisted ops) of the running AMP.

    Raises:
        StateError: amp_patch is not initialized with ``collect_stats=True``.

    Example::

        amp_patch.initialize(model, optimizer, opt_level="O1", collect_stats=True)
        train_one_epoch()          # warm-up
        amp_patch.reset_stats()
        train_one_epoch()
        print(amp_patch.report())  # the second epoch only
    """
    diag = _current("reset_stats")
    if diag.ledger is None:
        raise StateError(
            "amp_patch.reset_stats() has no op ledger to clear: collect_stats is off. "
            "Pass collect_stats=True to amp_patch.initialize to record ops."
        )
    diag.ledger.reset()


PLOT_EXTRA_HINT = "pip install -e '.[plot]' in a checkout of amp_patch, or pip install matplotlib"


def _loss_curves(rep: Report, given: Optional[Sequence[object]]) -> List[Tuple[str, List[int], List[float]]]:
    """``(label, steps, losses)`` to draw: the ``given`` per-step losses, or the
    recorded ones, one curve per loss id, averaged over the backwards of a step
    (gradient accumulation)."""
    if given is not None:
        vals = [float(v.detach().float().reshape(()).cpu()) if isinstance(v, torch.Tensor) else float(v) for v in given]
        return [("loss", list(range(len(vals))), vals)] if vals else []
    curves = []
    for lid in sorted({r[0] for r in rep.losses}):
        per_step: Dict[int, List[float]] = {}
        for i, step, v in rep.losses:
            if i == lid:
                per_step.setdefault(step, []).append(v)
        steps = sorted(per_step)
        curves.append((f"loss {lid}", steps, [sum(per_step[st]) / len(per_step[st]) for st in steps]))
    return curves


def _draw_losses(ax: Any, curves: List[Tuple[str, List[int], List[float]]], skipped: Dict[str, set]) -> None:
    finite_all = [v for _, _, vals in curves for v in vals if math.isfinite(v)]
    for label, steps, vals in curves:
        line = ax.plot([st for st, v in zip(steps, vals) if math.isfinite(v)], [v for v in vals if math.isfinite(v)],
                       label=label, lw=1.2)[0]
        bad = [st for st, v in zip(steps, vals) if not math.isfinite(v)]
        if bad:
            top = max(finite_all) if finite_all else 1.0
            ax.plot(bad, [top] * len(bad), "^", color="red", ms=4, label=f"{label}: inf/NaN ({len(bad)} steps)")
        sk = skipped.get(label, set())
        pts = [(st, v) for st, v in zip(steps, vals) if st in sk and math.isfinite(v)]
        if pts:
            ax.plot(*zip(*pts), "x", color=line.get_color(), label=f"{label}: step skipped")
    if finite_all and min(finite_all) > 0 and max(finite_all) / min(finite_all) > 50:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="best", fontsize="small")


def plot(path: "str | os.PathLike[str]", losses: Optional[Sequence[object]] = None) -> str:
    """Write a PNG of the loss over the steps beside each loss scaler's scale and skipped steps.

    Draws the running AMP's figures (after ``deinitialize``, the last run's).
    The loss is the true (unscaled) loss of every backward amp_patch scaled,
    one point per optimizer step (the mean of its backwards), with the skipped
    steps marked and inf/NaN losses drawn at the top; a run whose
    ``Tensor.backward`` is not patched (O0, O3 at a static scale of 1) records
    none, and ``losses=`` draws yours instead. A run that scales no loss (BF16)
    draws its static scale of 1.0 over the steps it took. With no step yet
    there is nothing to draw: the PNG says so, and so does an ``AmpWarning``.

    Args:
        path: where to write the PNG.
        losses: per-step losses to draw (numbers or one-element tensors, step
            0 first) in place of the recorded ones.

    Returns:
        the path written, as a string.

    Raises:
        ImportError: matplotlib is missing (``pip install -e '.[plot]'`` in a
            checkout of amp_patch, or ``pip install matplotlib``).
        StateError: no run has started yet.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1")
        train()
        amp_patch.plot("loss_scale.png")
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            f"amp_patch.plot() draws with matplotlib, which is not installed; install the extra: {PLOT_EXTRA_HINT}"
        ) from None
    if running.session() is None and running.last_ended() is None:
        raise StateError("amp_patch.plot() has no run to draw yet: call it after amp_patch.initialize(...) and some steps")
    rep = report()
    histories = [(s["loss_id"], s["history"]) for s in rep.loss_scale if s["history"]]
    curves = _loss_curves(rep, losses)
    # Figure + Agg canvas rather than pyplot: no global backend or figure state.
    if curves:  # the loss on the left, the scale and the skipped steps on the right
        fig = Figure(figsize=(12.5, 5), layout="constrained")
        FigureCanvasAgg(fig)
        grid = fig.add_gridspec(2, 2, height_ratios=(3, 1))
        left = fig.add_subplot(grid[:, 0])
        top = fig.add_subplot(grid[0, 1])
        bottom = fig.add_subplot(grid[1, 1], sharex=top)
        skipped = {f"loss {lid}": {st for st, _, sk in rows if sk} for lid, rows in histories} if losses is None else {}
        _draw_losses(left, curves, skipped)
        left.set_title(f"amp_patch loss ({rep.opt_level}, {rep.half_dtype})" + (": as given" if losses is not None else ""))
        top.tick_params(labelbottom=False)
    else:
        fig = Figure(figsize=(8, 5), layout="constrained")
        FigureCanvasAgg(fig)
        top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": (3, 1)})
    title = f"amp_patch loss scale ({rep.opt_level}, {rep.half_dtype})"
    if not histories:
        why = "no optimizer step yet (each step adds a point)" if rep.loss_scale else "this run has no loss scaler"
        top.text(0.5, 0.5, f"nothing to draw: {why}", ha="center", va="center", transform=top.transAxes)
        if not curves:
            warn_user(f"amp_patch.plot(): nothing to draw in {os.fspath(path)}: {why}")
    for loss_id, rows in histories:
        steps = [r[0] for r in rows]
        line = top.step(steps, [r[1] for r in rows], where="post", label=f"loss {loss_id}")[0]
        skipped = [(s, sc) for s, sc, sk in rows if sk]
        if skipped:
            top.plot(*zip(*skipped), "x", color=line.get_color(), label=f"loss {loss_id}: skipped")
            bottom.vlines([s for s, _ in skipped], 0, 1, color=line.get_color(), label=f"loss {loss_id}")
    if histories and all(sc == 1.0 for _, rows in histories for _, sc, _ in rows):
        title += ": static 1, no loss scaling"
    else:
        top.set_yscale("log", base=2)
    if histories:
        top.legend(loc="best", fontsize="small")
    top.set_ylabel("loss scale")
    top.set_title(title)
    bottom.set_yticks([])
    bottom.set_ylabel("skipped")
    bottom.set_xlabel("step")
    fig.savefig(os.fspath(path), format="png")
    return os.fspath(path)
