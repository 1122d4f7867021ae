"""Every script in examples/ runs, with small sizes, and prints what it claims.

Each runs in its own process, as a user would run it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str, launcher: bool = False) -> str:
    script = os.path.join(EXAMPLES, name)
    cmd = [sys.executable, "-m", "amp_patch", "run", script, *args] if launcher else [sys.executable, script, *args]
    # One thread: these are tiny workloads, and OpenMP threads waiting on a
    # busy machine cost more than they give.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("AMP_PATCH_LISTS", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return float(m.group(1))


def test_simplenet_benchmark():
    out = run_example("simplenet_benchmark.py", "--size", "32", "--batch-size", "8", "--batches", "2", "--epochs", "2")
    assert re.search(r"model output dtype = torch.float32\n\nDefault time:\ntotal time = [\d.]+ sec", out)
    assert re.search(r"model output dtype = torch.bfloat16\n\nAMP time in O1 mode:\ntotal time = [\d.]+ sec", out)
    assert re.search(r"\nAMP time in O2 mode:\ntotal time = [\d.]+ sec|\nO2 is not available in this build: ", out)
    losses = [float(v) for v in re.findall(r"loss = ([\d.]+)", out)]
    assert len(losses) >= 2 and losses[1] == pytest.approx(losses[0], rel=0.05)


def test_digits_cnn_fp32_vs_amp_accuracy():
    out = run_example("digits_cnn.py", "--epochs", "4")
    assert out.startswith("digits: 1348 training and 449 test images, 4 epochs, cpu")
    fp32 = _number(r"FP32: test accuracy ([\d.]+), last loss [\d.]+, logits in float32", out)
    amp = _number(r"O1: test accuracy ([\d.]+), last loss [\d.]+, logits in bfloat16", out)
    assert fp32 > 0.85 and amp > 0.85
    assert abs(amp - fp32) < 0.05
    assert _number(r"accuracy difference \(AMP - FP32\): ([+-][\d.]+)", out) == pytest.approx(amp - fp32, abs=2e-4)


def test_grad_accumulation_clipping_sees_unscaled_gradients():
    # FP16 on the CPU: slow, but it is where the loss scale is real (2**16).
    out = run_example("grad_accumulation_clipping.py", "--steps", "8", "--max-norm", "1.0", "--half-dtype", "float16")
    assert _number(r"largest gradient norm after clipping: ([\d.]+) \(max_norm 1.0\)", out) <= 1.0 + 1e-4
    before = _number(r"held-out loss: ([\d.]+) before training", out)
    after = _number(r"before training, ([\d.]+) after", out)
    assert after < before
    # a scaled gradient would be 2**15 or more times larger
    assert _number(r"gradient norm clipping sees: .* \(relative difference ([\d.e+-]+)\)", out) < 1e-2
    assert re.search(r"loss scale: 8 steps, \d+ skipped, scale now \d+", out)


def test_checkpoint_resume_is_bitwise():
    # FP16 with a scale so high the first steps overflow: the scaler's state
    # at the save differs from a fresh one, so restoring it matters.
    out = run_example("checkpoint_resume.py", "--steps", "6", "--half-dtype", "float16", "--init-scale", "16777216")
    m = re.search(r"saved at step 3 of 6 with loss scale ([\d.e+]+); restored ([\d.e+]+)", out)
    assert m, out
    assert float(m.group(1)) == float(m.group(2)) < 16777216
    assert "losses identical: True" in out
    assert "weights identical: True" in out


def test_yaml_override_moves_ops():
    out = run_example("yaml_override.py", "--steps", "2")
    default, override = out.split("\nwith yaml_override.yaml: ")
    assert default.startswith("default lists: tanh float32, fc bfloat16")
    assert override.startswith("tanh bfloat16, fc float32")
    # The default run's report shows tanh as an FP32 op no list covers ...
    unlisted = default.split("unlisted ops seen")[1]
    assert re.search(r"\n\s+torch\.tanh\s+\d+", unlisted)
    # ... and the override's report files it under half, and linear under float.
    assert re.search(r"policy half:\n\s+torch\.tanh\s+2\s+bfloat16", override)
    assert re.search(r"policy float:\n\s+torch\.nn\.functional\.linear\s+2\s+float32", override)


def test_apex_era_script_through_the_launcher():
    out = run_example("apex_era_script.py", "--steps", "6", launcher=True)
    assert "apex.amp is amp_patch.amp" in out
    assert "logits dtype: torch.float32" in out  # model outputs come back in FP32 (cast_model_outputs)
    first = _number(r"step 0: loss ([\d.]+)", out)
    last = _number(r"step 5: loss ([\d.]+)", out)
    assert last < first
    assert re.search(r"loss scaler state: \{.*'loss_scale': 1\.0", out)
