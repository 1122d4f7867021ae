"""Complete Apex-era training scripts run unmodified under ``amp-patch run`` on CPU
(tests/scripts/apex_era/), and ``amp-patch check-script`` on them.

Each script is written as its kind was written for Apex (the ImageNet example
with apex.parallel, apex.fp16_utils, apex.optimizers and amp_C; the DCGAN
example with three losses; a 2018 ``amp.init`` script; an ``FP16_Optimizer``
trainer), with tiny synthetic data. Each run is a subprocess (marked slow).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from amp_patch.frontends import cli, scan
from helpers import ENV

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "apex_era"
REPO = Path(__file__).resolve().parents[2]


def run(args, tmp_path, timeout=240, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ENV}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    proc = subprocess.run(args, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    found = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert found, f"no RESULT line\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return found, proc


def launcher(*args):
    return [sys.executable, "-m", "amp_patch", "run", *args]


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_check_script_finds_every_apex_name_served(name, capsys):
    assert cli.main(["check-script", str(SCRIPTS / name)]) == 0
    out = capsys.readouterr().out
    assert "all served by amp_patch" in out and "NOT served" not in out


@pytest.mark.quick
def test_check_script_names_what_is_not_served_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from apex import amp\nfrom apex.contrib.fmha import FMHA\n"
        "import apex\nmodel = apex.parallel.convert_syncbn_model(model)\n"
        "amp._amp_state.loss_scalers[0]._loss_scale = 2**20\namp.no_such_thing()\n"
    )
    assert cli.main(["check-script", str(script)]) == 1
    out = capsys.readouterr().out
    assert "4 Apex name(s), 2 not served" in out
    assert re.search(r"apex.contrib.fmha.FMHA +NOT served: apex.contrib has no 'fmha'", out)
    assert "use torch.nn.functional.scaled_dot_product_attention" in out
    assert "apex.amp.no_such_thing()" in out and "apex.amp has no 'no_such_thing'" in out
    assert "apex.parallel.convert_syncbn_model()" in out
    assert "served by amp_patch.apex.parallel.convert_syncbn_model()" in out
    assert "served by amp_patch.amp._amp_state.loss_scalers[]._loss_scale" in out
    assert not marker.exists()


def test_check_script_on_a_script_with_no_apex_and_on_bad_input(tmp_path, capsys):
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nprint(torch.ones(1))\n")
    assert cli.main(["check-script", str(plain)]) == 0
    assert "uses no Apex names" in capsys.readouterr().out
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert cli.main(["check-script", str(broken)]) == 2
    assert "does not parse (line 1" in capsys.readouterr().err
    assert cli.main(["check-script", str(tmp_path / "missing.py")]) == 2


def test_scan_reads_star_imports_and_aliases():
    uses = {u.name: u for u in scan.scan(
        "from apex.fp16_utils import *\nimport apex.amp as A\nfrom apex.parallel import DistributedDataParallel as DDP\n"
        "A.scale_loss\nDDP(m)\n")}
    assert uses["apex.fp16_utils.*"].served_by == "amp_patch.apex.fp16_utils.*"
    assert uses["apex.amp.scale_loss"].line == 4
    assert uses["apex.parallel.DistributedDataParallel()"].served_by.endswith("DistributedDataParallel()")


@pytest.mark.slow
@pytest.mark.parametrize("level,half", [("O2", "float16"), ("O1", "bfloat16"), ("O3", "bfloat16")])
def test_imagenet_style_script(tmp_path, level, half):
    (r,), proc = run(launcher("--half-dtype", half, str(SCRIPTS / "imagenet_amp.py"), str(tmp_path / "ck.pt"),
                              "--opt-level", level), tmp_path)
    assert r["opt_level"] == level and r["amp_module"] == "amp_patch.amp"
    assert all(math.isfinite(v) for v in r["losses"] + r["grad_norms"])
    assert sum(r["losses"][-3:]) < sum(r["losses"][:3])  # the same three batches, one epoch later
    assert r["output_dtype"] == "torch.float32"  # Apex's O2 cast outputs to FP32 too
    if level == "O1":
        assert r["weight_dtype"] == r["bn_dtype"] == "torch.float32"
    else:
        assert r["weight_dtype"] == f"torch.{half}"
        assert r["bn_dtype"] == ("torch.float32" if level == "O2" else f"torch.{half}")  # O2 keeps batchnorm FP32
    assert r["saved_dtype"] == "torch.float32"  # checkpoints hold FP32 weights, as Apex's O2 did
    if half == "float16" and level == "O2":
        assert r["scales"][0] == 65536.0  # Apex's dynamic scaler
    assert proc.stderr.count("resolves to amp_patch.amp") == 1


@pytest.mark.slow
def test_imagenet_style_script_under_torchrun_with_apex_ddp_and_sync_bn(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    found, _ = run([shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "amp_patch", "run", "--half-dtype", "bfloat16", str(SCRIPTS / "imagenet_amp.py"),
                    str(tmp_path / "ck.pt"), "--opt-level", "O2", "--sync_bn"], tmp_path, timeout=300,
                   OMP_NUM_THREADS="1")
    assert sorted(r["rank"] for r in found) == [0, 1]
    a, b = found
    assert a["checksum"] == b["checksum"]  # the ranks end identical
    assert a["losses"] == b["losses"]  # the reduced loss
    assert a["ddp"] == "amp_patch.apex.parallel.distributed"


@pytest.mark.slow
def test_dcgan_style_script_with_three_losses(tmp_path):
    (r,), _ = run(launcher("--half-dtype", "float16", str(SCRIPTS / "dcgan_amp.py"), "--niter", "2"), tmp_path)
    assert sorted(r["state"]) == ["amp_patch", "loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert r["scales"] == [r["state"][f"loss_scaler{i}"]["loss_scale"] for i in range(3)]
    assert all(r["state"][f"loss_scaler{i}"]["steps"] == 4 for i in range(3))  # each loss fed 4 steps
    assert all(math.isfinite(v) for pair in r["errs"] for v in pair)
    assert r["fake_dtype"] == "torch.float32"


@pytest.mark.slow
@pytest.mark.parametrize("outputs", ["half", "float32"])
def test_2018_amp_init_script(tmp_path, outputs):
    (r,), proc = run(launcher("--half-dtype", "float16", "--outputs", outputs, str(SCRIPTS / "amp_init_2018.py")), tmp_path)
    # the script calls model[0] on its own, an outermost module call: the
    # launcher's default returns it FP32, --outputs half as Apex computed it
    linear = "torch.float16" if outputs == "half" else "torch.float32"
    assert r["active"] and r["dtypes"] == {"linear": linear, "gelu_fast": "torch.float32"}
    assert r["after"] == "torch.float32"  # handle._deactivate() ended the run
    assert r["losses"][-1] < r["losses"][0]


@pytest.mark.slow
def test_fp16_optimizer_script(tmp_path):
    (r,), _ = run(launcher(str(SCRIPTS / "fp16_optimizer_lm.py"), str(tmp_path / "ck.pt")), tmp_path)
    assert r["weight_dtype"] == "torch.float16" and r["master_dtype"] == "torch.float32"
    assert r["losses"][-1] < r["losses"][0]
    assert all(s > 0 for s in r["scales"])
