"""``amp-patch compare``: a script run at several opt levels, each in its own
process, its loss followed step by step, and what compare says about it.

The end-to-end tests run the real command on small scripts (and on the
examples) and read back the CSV, the table and the messages; the verdicts
themselves (divergence, departure) are also tested on made-up runs."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amp_patch.frontends import cli, compare
from amp_patch.frontends.compare import LevelRun, departure, divergence, judge, smooth
from helpers import write

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("clean_env")

# prints each step's loss as Python wrote it, so the test can hold compare's CSV against it
TRAIN = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(2)
x = torch.randn(64, 16, generator=g)
y = x[:, :4].argmax(1)
for step in range(50):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print("loss", step, repr(loss.item()), flush=True)
print("the script ran to its end")
"""

# FP32 trains; in FP16 the first layer's output overflows (65504 is FP16's largest)
DIVERGE = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
with torch.no_grad():
    model[0].weight.mul_(10)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 16) * 1e4
x.clamp_(-6e4, 6e4)  # every input fits in FP16; the products with the weights do not
y = torch.randint(0, 4, (64,))
for step in range(30):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
"""

# its own seed, a DataLoader with worker processes, and its own initialize at O2
OWN = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import amp_patch

if __name__ == "__main__":
    torch.manual_seed(123)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=True)
    for epoch in range(3):
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb).float(), yb)
            loss.backward()
            opt.step()
    print("the script ran to its end")
"""

NO_BACKWARD = """
import torch
print("evaluating only:", torch.ones(3).sum().item())
"""


# trains with a hand-written update (the PyTorch examples' word language model
# without --use-optimizer): no optimizer for O2 to attach its model to
NO_OPTIMIZER = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
x = torch.randn(64, 16)
y = x[:, :4].argmax(1)
for step in range(20):
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
"""


# native AMP: the script scales its own loss with torch.amp.GradScaler
NATIVE_AMP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 16)
y = x[:, :4].argmax(1)
for step in range(10):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def run_compare(args, cwd, timeout=600):
    res = subprocess.run([sys.executable, "-m", "amp_patch", "compare", *args], cwd=cwd, capture_output=True,
                         text=True, timeout=timeout)
    return res


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    by_level = {}
    for r in rows:
        by_level.setdefault(r["level"], []).append(r)
    return rows, by_level


def printed_losses(log):
    return [float(line.split()[2]) for line in Path(log).read_text().splitlines() if line.startswith("loss ")]


# ------------------------------------------------------------- end to end


@pytest.mark.slow
def test_compare_follows_the_true_loss_of_each_step_and_writes_the_csv(tmp_path):
    script = write(tmp_path, "train.py", TRAIN)
    out = tmp_path / "out"
    res = run_compare(["--steps", "6", "--levels", "FP32,O1", "--half-dtype", "float16", "--out", str(out), str(script)],
                      tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows, by_level = read_csv(out / "compare.csv")
    assert list(rows[0]) == list(compare.CSV_FIELDS)
    assert set(by_level) == {"FP32", "O1"}
    for level, half in (("FP32", "float32"), ("O1", "float16")):
        got = by_level[level]
        assert [int(r["step"]) for r in got] == list(range(6))
        assert {r["half_dtype"] for r in got} == {half}
        # the loss the script itself saw at each step: FP16's is the true loss, not the scaled one
        assert [float(r["loss"]) for r in got] == printed_losses(out / f"{level}.log")[:6]
        assert all(float(r["step_time_s"]) > 0 for r in got)
        # stopped after 6 steps: the script never reached its last line
        assert "the script ran to its end" not in (out / f"{level}.log").read_text()
    assert {r["loss_scale"] for r in by_level["FP32"]} == {""}
    assert float(by_level["O1"][0]["loss_scale"]) == 65536.0  # FP16's dynamic scale, as it started
    # the same seed, the same first batch: the first losses agree to FP16's precision
    assert math.isclose(float(by_level["O1"][0]["loss"]), float(by_level["FP32"][0]["loss"]), rel_tol=1e-2)
    lines = res.stdout.splitlines()
    assert any(line.startswith("FP32 ") and " 6 " in line for line in lines)
    assert any(line.startswith("O1 ") and "float16, loss scaled" in line for line in lines)
    assert "O1: stayed within 10% of FP32's loss at every step" in res.stdout
    if (out / "compare.png").exists():
        assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    else:
        pytest.importorskip("matplotlib")  # drawn whenever matplotlib is there
        raise AssertionError("no compare.png with matplotlib installed")


@pytest.mark.slow
def test_compare_says_when_a_level_diverged_and_names_the_op(tmp_path):
    script = write(tmp_path, "diverge.py", DIVERGE)
    out = tmp_path / "out"
    res = run_compare(["--steps", "6", "--levels", "FP32,O1", "--half-dtype", "float16", "--out", str(out), str(script)],
                      tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr  # a level diverged
    _, by_level = read_csv(out / "compare.csv")
    assert all(math.isfinite(float(r["loss"])) for r in by_level["FP32"])
    assert all(r["skipped"] == "0" for r in by_level["FP32"])
    o1 = by_level["O1"]
    assert all(not math.isfinite(float(r["loss"])) for r in o1)
    assert all(r["skipped"] == "1" for r in o1)
    scales = [float(r["loss_scale"]) for r in o1]
    assert scales == sorted(scales, reverse=True) and scales[0] > scales[-1]  # backing off at every skip
    assert "O1: DIVERGED at step 0: its loss is nan there" in res.stdout
    # the rerun with overflow provenance armed names the op that overflowed, and the fix
    assert "rerun with overflow provenance armed" in res.stdout
    assert "the overflow provenance names torch.nn.functional.linear" in res.stdout
    assert "held inf/NaN in float16, from finite inputs" in res.stdout
    assert "float: [linear]" in res.stdout
    assert (out / "O1.find_overflow.log").exists()


@pytest.mark.slow
def test_the_override_the_provenance_suggests_stops_the_divergence(tmp_path):
    script = write(tmp_path, "diverge.py", DIVERGE)
    lists = write(tmp_path, "fp32_linear.yaml", "torch.nn.functional:\n  float: [linear]\n")
    out = tmp_path / "out"
    res = run_compare(["--steps", "6", "--levels", "FP32,O1", "--half-dtype", "float16", "--lists", str(lists),
                       "--out", str(out), str(script)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    _, by_level = read_csv(out / "compare.csv")
    assert all(math.isfinite(float(r["loss"])) for r in by_level["O1"])
    assert "DIVERGED" not in res.stdout and "rerun" not in res.stdout


@pytest.mark.slow
def test_a_script_with_its_own_seed_workers_and_initialize_is_compared_at_each_level(tmp_path):
    script = write(tmp_path, "own.py", OWN)
    out = tmp_path / "out"
    res = run_compare(["--steps", "5", "--levels", "FP32,O4", "--out", str(out), str(script)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "own.py:12 calls amp_patch.initialize itself" in res.stdout
    assert "own.py:12's initialize (opt_level O2) ran at O4 without its keep_batchnorm_fp32" in res.stdout
    _, by_level = read_csv(out / "compare.csv")
    # the script asked for O2; compare ran it at each level it was asked for
    assert [r["opt_level"] for r in by_level["FP32"]] == ["O0"] * 5
    assert [r["opt_level"] for r in by_level["O4"]] == ["O4"] * 5
    assert {r["half_dtype"] for r in by_level["O4"]} == {"bfloat16"}
    assert math.isclose(float(by_level["O4"][0]["loss"]), float(by_level["FP32"][0]["loss"]), rel_tol=2e-2)
    for level in ("FP32", "O4"):
        assert "the script ran to its end" not in (out / f"{level}.log").read_text()


@pytest.mark.slow
def test_a_script_that_never_calls_backward_gets_a_clear_message(tmp_path):
    script = write(tmp_path, "evaluate.py", NO_BACKWARD)
    res = run_compare(["--steps", "5", "--levels", "FP32", "--out", str(tmp_path / "out"), str(script)], tmp_path)
    assert res.returncode == 1
    assert "FP32: evaluate.py never called loss.backward() on a one-element loss" in res.stdout
    assert "evaluating only: 3.0" in (tmp_path / "out" / "FP32.log").read_text()
    assert not (tmp_path / "out" / "compare.csv").exists()


@pytest.mark.slow
def test_a_level_that_ran_in_fp32_says_so_and_claims_no_speedup(tmp_path):
    """O2 needs an optimizer to hold its model's masters: a script that updates
    its weights by hand runs in FP32 there. compare says so, with the
    launcher's reason, instead of reporting an O2 that never ran."""
    script = write(tmp_path, "by_hand.py", NO_OPTIMIZER)
    out = tmp_path / "out"
    res = run_compare(["--steps", "12", "--levels", "FP32,O4,O5", "--out", str(out), str(script)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("O5 "))
    assert "float32 (no AMP ran)" in line and line.rstrip().endswith("-"), line  # no speedup claimed
    assert ("O5: ran in FP32, not at O5: the script built no optimizer for the launcher to attach its model to; "
            "its figures are FP32's") in res.stdout
    assert "O5: stayed within" not in res.stdout
    o4 = next(x for x in res.stdout.splitlines() if x.startswith("O4 "))
    assert "bfloat16" in o4 and "O4: stayed within" in res.stdout  # O1/O4 need no optimizer
    _, by_level = read_csv(out / "compare.csv")
    assert {r["opt_level"] for r in by_level["O5"]} == {"O0"}


@pytest.mark.slow
def test_a_script_with_its_own_grad_scaler_is_compared_as_the_fp32_run_it_is(tmp_path):
    """The launcher turns its AMP off for a script with its own GradScaler: the
    level is reported as FP32, with that reason, not as an O1 that ran."""
    script = write(tmp_path, "native.py", NATIVE_AMP)
    res = run_compare(["--steps", "6", "--levels", "FP32,O1", "--half-dtype", "float16", "--out", str(tmp_path / "out"),
                       str(script)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("O1: ran in FP32, not at O1: the script runs its own mixed precision (torch.amp.GradScaler), so the "
            "launcher turned its AMP off") in res.stdout
    _, by_level = read_csv(tmp_path / "out" / "compare.csv")
    assert {r["opt_level"] for r in by_level["O1"]} == {"O0"}


@pytest.mark.slow
@pytest.mark.parametrize("example, args", [
    ("apex_era_script.py", ["--steps", "20"]),            # from apex import amp; amp.initialize; scale_loss
    ("grad_accumulation_clipping.py", []),                # several backwards per optimizer step
])
def test_compare_on_the_examples(tmp_path, example, args):
    out = tmp_path / "out"
    res = run_compare(["--steps", "4", "--levels", "FP32,O4", "--out", str(out), str(ROOT / "examples" / example), *args],
                      tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    _, by_level = read_csv(out / "compare.csv")
    assert [len(by_level[lv]) for lv in ("FP32", "O4")] == [4, 4]
    for lv in ("FP32", "O4"):
        assert all(math.isfinite(float(r["loss"])) and float(r["loss"]) > 0 for r in by_level[lv])
    assert "O4: " in res.stdout and "DIVERGED" not in res.stdout


# ------------------------------------------------------------- the verdicts


def _run(name, losses, skipped=None):
    skipped = skipped or [0] * len(losses)
    rows = [{"loss": v, "skipped": s, "loss_scale": None, "step_time_s": 0.01} for v, s in zip(losses, skipped)]
    return LevelRun(name, "O0" if name == "FP32" else "O1", "float16", rows, "steps", None, 1.0, "x.log", [])


@pytest.mark.quick
def test_divergence_is_a_non_finite_loss_or_every_step_skipped_to_the_end():
    ref = _run("FP32", [2.0, 1.5, 1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.3, 0.2])
    assert divergence(_run("O1", [2.0, 1.5, float("nan"), 1.0] + [0.5] * 6), ref) == (2, "its loss is nan there")
    stalled = _run("O1", [2.0, 1.5, 1.2] + [1.2] * 7, skipped=[0, 0, 0] + [1] * 7)
    assert divergence(stalled, ref) == (3, "every step from there to the end (7) was skipped for inf/NaN gradients")
    # a few skips that end (the dynamic loss scale at work) are not divergence
    assert divergence(_run("O1", ref.losses, skipped=[1, 1, 1, 0, 0, 0, 0, 0, 0, 0]), ref) == (None, None)
    rose = _run("O1", [2.0, 1.9, 2.0, 2.2, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0])
    at, why = divergence(rose, ref)
    assert at == 9 and "rose from 2 to 5 while FP32's fell" in why


@pytest.mark.quick
def test_departure_is_the_first_step_the_smoothed_loss_moves_past_the_threshold():
    ref = _run("FP32", [1.0] * 40)
    near = _run("O1", [1.0 + 0.01 * ((-1) ** i) for i in range(40)])
    assert departure(near, ref, 0.1) == (None, None)
    drift = _run("O1", [1.0] * 20 + [1.5] * 20)
    at, (a, b) = departure(drift, ref, 0.1)
    assert 20 <= at <= 21 and b == 1.0 and a > 1.1
    assert smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    assert math.isnan(smooth([1.0, float("inf"), 1.0], 2)[2])


@pytest.mark.quick
def test_the_verdict_compares_final_losses_and_step_times_with_the_reference():
    ref = _run("FP32", [1.0] * 30)
    run = _run("O1", [1.1] * 30)
    for r in run.rows:
        r["step_time_s"] = 0.005
    v = judge(run, ref, 0.2)
    assert v.final == pytest.approx(1.1) and v.gap == pytest.approx(0.1) and v.rel_gap == pytest.approx(0.1)
    assert v.speedup == pytest.approx(2.0) and v.diverged_at is None and v.departed_at is None


@pytest.mark.quick
def test_bad_command_lines_exit_2_before_anything_runs(tmp_path, capsys):
    script = write(tmp_path, "t.py", "print('ran')\n")
    assert cli.main(["compare", "--levels", "FP32,O9", str(script)]) == 2
    assert "unknown level O9" in capsys.readouterr().err
    assert cli.main(["compare", "--levels", "FP32,O0", str(script)]) == 2  # FP32 is O0: named twice
    assert cli.main(["compare", "--steps", "3"]) == 2
    assert "the script to run is missing" in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.quick
def test_the_script_keeps_its_own_arguments(tmp_path):
    opts = compare.parse(["--steps", "7", "--levels", "fp32,o2", str(write(tmp_path, "t.py", "")),
                          "--steps", "99", "--", "--levels"])
    assert opts.steps == 7 and opts.levels == ["FP32", "O2"] and opts.args == ["--steps", "99", "--", "--levels"]
    assert opts.reference == "FP32" and opts.half_dtype is None


def test_compare_is_a_cli_subcommand():
    assert "compare" in cli._main_parser()._subparsers._group_actions[0].choices
    res = subprocess.run([sys.executable, "-m", "amp_patch", "compare", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ))
    assert res.returncode == 0 and "--levels" in res.stdout and "--threshold" in res.stdout
