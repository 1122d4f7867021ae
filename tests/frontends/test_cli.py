"""The amp-patch command: run, lists, check, demo. In process where that
suffices; the end-to-end runs of unmodified scripts are in subprocesses
(marked slow: each starts Python and imports torch)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

import amp_patch
from amp_patch import frontend, oplists
from amp_patch.oplists import view
from amp_patch.frontends import cli
from helpers import ENV, write

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def marker_script(tmp_path):
    """A script that leaves a file behind if it ever starts."""
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    return script, marker


# ----------------------------------------------------------- run: bad input


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run"], "the script to run is missing"),
        (["run", "--opt-level", "O8", "{script}"], "--opt-level='O8' is not an opt level"),
        (["run", "--half-dtype", "float64", "{script}"], "--half-dtype='float64' is not supported"),
        (["run", "--loss-scale", "0", "{script}"], "--loss-scale='0' is not a loss scale"),
        (["run", "--bogus", "{script}"], "unrecognized arguments: --bogus"),
        (["run", "--opt", "O1", "{script}"], "unrecognized arguments: --opt"),  # no abbreviations
        (["run", "--lists", "{missing}", "{script}"], "missing.yaml: no such op-list file"),
        (["run", "{missing_script}"], "script '{missing_script}' does not exist"),
        # python DIR says this in one line; so does the launcher, before anything starts
        (["run", "{folder}"], "can't find '__main__' module in '{folder}'"),
    ],
)
def test_bad_run_input_exits_2_without_starting_the_script(capsys, marker_script, tmp_path, argv, message):
    script, marker = marker_script
    subs = {"script": str(script), "missing": str(tmp_path / "missing.yaml"), "missing_script": str(tmp_path / "gone.py"),
            "folder": str(tmp_path)}
    argv = [a.format(**subs) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(**subs) in err and "usage: amp-patch run" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert not marker.exists() and not amp_patch.is_initialized()


def test_bad_lists_file_content_exits_2_with_file_and_line(capsys, marker_script, tmp_path):
    script, marker = marker_script
    bad = write(tmp_path, "bad.yaml", "torch:\n  half: [mm]\n  flaot: [cumsum]\n")
    assert cli.main(["run", "--lists", str(bad), str(script)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3: torch.flaot is not a policy; did you mean 'float'?" in err
    assert not marker.exists()


def test_bad_environment_variable_exits_2_naming_it(capsys, marker_script, monkeypatch):
    script, marker = marker_script
    monkeypatch.setenv("AMP_PATCH_OPT_LEVEL", "O8")
    assert cli.main(["run", str(script)]) == 2
    assert "AMP_PATCH_OPT_LEVEL='O8' is not an opt level" in capsys.readouterr().err
    assert not marker.exists()


def test_run_help_exits_0(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--opt-level" in out
    assert "O4: the BF16 form of O1 (torch functions cast, in BF16)" in out
    assert "O5: the BF16 form of O2 (model cast, FP32 master weights, in BF16)" in out


@pytest.mark.parametrize("argv, says", [
    (["check", "--help"], "Validate op-list override files against the shipped lists and this torch"),
    (["check-script", "--help"], "Read a training script written for NVIDIA Apex, without running it"),
    (["lists", "--help"], "yaml: the same policy as an op-list override file"),
])
def test_every_subcommand_and_option_has_help(capsys, argv, says):
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert says in out
    parser = cli._main_parser()._subparsers._group_actions[0].choices[argv[0]]
    assert parser.description
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]


@pytest.mark.parametrize("argv, says", [
    (["run", "--opt-lvl", "O1", "{script}"], "unrecognized arguments: --opt-lvl (did you mean --opt-level?)"),
    (["run", "--optlevel=O1", "{script}"], "unrecognized arguments: --optlevel=O1 (did you mean --opt-level?)"),
    (["lists", "--formt", "yaml"], "unrecognized arguments: --formt yaml (did you mean --format?)"),
    (["lists", "--formt", "yaml", "--devise", "cpu"], "(did you mean --format for --formt, --device for --devise?)"),
    (["compare", "--step", "3", "{script}"], "unrecognized arguments: --step (did you mean --steps?)"),
    (["demo", "--sise", "8"], "unrecognized arguments: --sise 8 (did you mean --size?)"),
    (["run", "--bogus", "{script}"], "unrecognized arguments: --bogus\n"),  # nothing near it: no guess
])
def test_a_misspelled_option_gets_the_nearest_valid_one(capsys, marker_script, argv, says):
    script, marker = marker_script
    assert cli.main([a.format(script=script) for a in argv]) == 2
    assert says in capsys.readouterr().err
    assert not marker.exists()


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "{run,lists,check,check-script,demo,compare}" in capsys.readouterr().err


# ------------------------------------------------------ run: pass-through


def test_script_arguments_reach_the_script_exactly(tmp_path, capsys):
    script = write(tmp_path, "echo.py", "import sys, json\nprint(json.dumps(sys.argv[1:]))\n")
    args = ["--opt-level", "O3", "--", "-x", "--lists", "a b"]
    assert cli.main(["run", "--opt-level", "O0", str(script), *args]) == 0
    assert json.loads(capsys.readouterr().out) == args


def test_run_double_dash_separates_the_script(tmp_path, capsys):
    script = write(tmp_path, "echo.py", "import sys, json\nprint(json.dumps(sys.argv[1:]))\n")
    assert cli.main(["run", "--opt-level", "O0", "--", str(script), "--", "z"]) == 0
    assert json.loads(capsys.readouterr().out) == ["--", "z"]


def test_script_exit_code_passes_through(tmp_path):
    script = write(tmp_path, "leave.py", "import sys\nsys.exit(7)\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--opt-level", "O0", str(script)])
    assert info.value.code == 7
    text = write(tmp_path, "leave_text.py", "import sys\nsys.exit('fatal: bad data')\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--opt-level", "O0", str(text)])
    assert info.value.code == "fatal: bad data"


def test_script_traceback_is_printed_as_python_prints_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(frontend, "adopt_optimizer", lambda opt: None)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    script = write(tmp_path, "fails.py", """\
        def helper():
            raise KeyError("missing column")

        helper()
    """)
    assert cli.main(["run", str(script)]) == 1
    err = capsys.readouterr().err
    every = err.splitlines()
    # the launcher's own two lines: what it turned on, first; what ran, just before the traceback
    ours = [i for i, line in enumerate(every) if line.startswith("amp-patch run: ")]
    assert ours == [0, every.index("Traceback (most recent call last):") - 1]
    lines = every[1:ours[1]] + every[ours[1] + 1:]
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1] == f'  File "{script}", line 4, in <module>'
    assert lines[-1] == "KeyError: 'missing column'"
    assert "runpy" not in err and "launcher.py" not in err and "cli.py" not in err
    assert not amp_patch.is_initialized()


def test_a_script_that_does_not_compile_is_reported_as_python_reports_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    script = write(tmp_path, "broken.py", "x = 1\ndef f(:\n    pass\n")
    want = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert cli.main(["run", str(script)]) == want.returncode == 1
    err = capsys.readouterr().err
    got = [line for line in err.splitlines()
           if "AmpWarning" not in line and "sys.exit" not in line and not line.startswith("amp-patch run: ")]
    assert got == want.stderr.splitlines() and got[-1] == "SyntaxError: invalid syntax"
    assert not amp_patch.is_initialized()


# --------------------------------------------------------------------- lists


@pytest.mark.quick
def test_lists_table_shows_every_effective_op_with_its_source(capsys):
    assert cli.main(["lists", "--half-dtype", "bfloat16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): line.split() for line in out if not line.startswith(("#", "namespace", "-"))}
    expected = oplists.load().resolve(torch.bfloat16, "cpu")
    assert set(rows) == set(expected)
    for key, entry in expected.items():
        assert rows[key][2] == entry.policy, key
        assert rows[key][3:5] == ["default", entry.source], key
    assert out[0] == f"# effective op policy for bfloat16 on cpu (torch {torch.__version__})"


def test_lists_shows_overrides_missing_ops_and_banned_by_dtype(capsys, tmp_path):
    override = write(tmp_path, "ov.yaml", """\
        torch.nn.functional:
          float: [linear]
          remove: [softmax]
        torch:
          half:
            - name: op_from_the_future
              optional: true
    """)
    assert cli.main(["lists", "--lists", str(override), "--half-dtype", "float16", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines() if not line.startswith("#")}
    assert rows[("torch.nn.functional", "linear")].split()[2:5] == ["float", "override", f"{override}:2"]
    assert ("torch.nn.functional", "softmax") not in rows  # FP32 under float16 by default
    assert "missing from torch" in rows[("torch", "op_from_the_future")]
    assert rows[("torch.nn.functional", "binary_cross_entropy")].split()[2] == "banned"
    assert "1 missing from this torch" in out.splitlines()[-1]


def test_lists_yaml_is_machine_readable_and_agrees_with_the_loader(capsys):
    assert cli.main(["lists", "--format", "yaml", "--half-dtype", "bf16", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    doc = yaml.safe_load(text)
    got = {(ns, op if isinstance(op, str) else op["name"]): policy
           for ns, policies in doc.items() for policy, ops in policies.items() for op in ops}
    expected = oplists.load().resolve(torch.bfloat16, "cpu")
    # every op an entry names; the in-place forms that follow their op are derived again on loading
    assert got == {k: e.policy for k, e in expected.items() if not e.derived_from}
    assert "bfloat16 on cpu" in text.splitlines()[0]
    bce = next(line for line in text.splitlines() if line.strip().startswith("- binary_cross_entropy "))
    assert bce.startswith("    - binary_cross_entropy  # default lists/torch.nn.functional.yaml:")
    assert bce.endswith("; banned under float16")
    addmm = next(line for line in text.splitlines() if line.startswith("    - addmm  # default lists/torch.Tensor.yaml:"))
    assert addmm.endswith("in-place addmm_ follows it")


def test_lists_yaml_is_an_override_file_that_check_and_initialize_accept(capsys, tmp_path):
    """`amp-patch lists --format yaml > policy.yaml; amp-patch check policy.yaml`: no
    problems, and the file loaded as the only override gives the same policy back."""
    override = write(tmp_path, "ov.yaml", """\
        torch.nn.functional:
          float: [linear]
          remove: [conv2d]
        torch:
          half:
            - name: op_from_the_future
              optional: true
    """)
    where = ["--half-dtype", "bf16", "--device", "cpu"]
    assert cli.main(["lists", "--format", "yaml", "--lists", str(override), *where]) == 0
    policy = tmp_path / "policy.yaml"
    policy.write_text(capsys.readouterr().out)
    assert cli.main(["check", str(policy)]) == 0
    assert capsys.readouterr().out == f"{policy}: no problems\n"

    def table(lists):
        rows, _, _ = view.effective(lists, "bfloat16", "cpu")
        return {(r.namespace, r.op): (r.policy, r.missing, r.derived_from) for r in rows}

    assert table([str(policy)]) == table([str(override)]) != table([])
    doc = yaml.safe_load(policy.read_text())
    assert "linear" in doc["torch.nn.functional"]["float"] and doc["torch.nn.functional"]["remove"] == ["conv2d"]
    assert {"name": "op_from_the_future", "optional": True} in doc["torch"]["half"]
    assert f"    - linear  # override {override}:2" in policy.read_text().splitlines()
    model = torch.nn.Linear(4, 4)
    amp_patch.initialize(model, opt_level="O4", lists=str(policy), verbosity=0)  # no ListError
    try:
        assert amp_patch.is_initialized()
    finally:
        amp_patch.deinitialize()


def test_lists_honours_the_environment_variable(capsys, tmp_path, monkeypatch):
    override = write(tmp_path, "env.yaml", "torch:\n  half: [cumsum]\n")
    monkeypatch.setenv("AMP_PATCH_LISTS", str(override))
    assert cli.main(["lists", "--device", "cpu"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.split()[:2] == ["torch", "cumsum"])
    assert line.split()[2:5] == ["half", "override", f"{override}:2"]


def test_lists_with_bad_input_exits_2(capsys, tmp_path):
    assert cli.main(["lists", "--half-dtype", "float64"]) == 2
    assert "--half-dtype='float64' is not supported" in capsys.readouterr().err
    assert cli.main(["lists", "--format", "json"]) == 2
    assert cli.main(["lists", "--lists", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such op-list file" in capsys.readouterr().err


# --------------------------------------------------------------------- check


@pytest.mark.quick
def test_check_prints_every_problem_with_file_line_and_nearest_name(capsys, tmp_path):
    bad = write(tmp_path, "bad.yaml", """\
        torch.nn.functional:
          float: [linear, sofmax]
        torch:
          haf: [mm]
          half:
            - name: cumsum
              wen: {dtype: float16}
    """)
    assert cli.main(["check", str(bad)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines == [
        f"{bad}:2: torch.nn.functional.float[1] 'sofmax' is not in torch.nn.functional; did you mean 'softmax'? "
        "(mark it 'optional: true' if it exists only in some torch versions)",
        f"{bad}:4: torch.haf is not a policy; did you mean 'half'? (valid: half, float, promote, sequence_promote, banned, remove)",
        f"{bad}:6: torch.half[0] has unknown key 'wen'; did you mean 'when'? (valid: name, when, optional, why, fix)",
    ]
    assert "3 problems found" in err


def test_check_reports_malformed_yaml_with_its_line(capsys, tmp_path):
    bad = write(tmp_path, "broken.yaml", "torch:\n  half: [mm\n  float: [x]\n")
    assert cli.main(["check", str(bad)]) == 1
    assert capsys.readouterr().out.startswith(f"{bad}:")


def test_check_a_valid_file_exits_0(capsys, tmp_path):
    good = write(tmp_path, "good.yaml", "torch.nn.functional:\n  float: [linear]\n  remove: [softmax]\n")
    assert cli.main(["check", str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: no problems"


def test_check_a_missing_file_exits_2(capsys, tmp_path):
    assert cli.main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


# ---------------------------------------------------------------------- demo


def test_demo_dispatches_to_the_demo_module(monkeypatch):
    calls = []
    fake = types.ModuleType("amp_patch.frontends.demo")
    fake.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, "amp_patch.frontends.demo", fake)
    assert cli.main(["demo", "--steps", "5"]) == 3
    assert calls == [["--steps", "5"]]


def test_demo_missing_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "amp_patch.frontends.demo", None)  # as if the file were absent
    assert cli.main(["demo"]) == 2
    assert "the demo is not part of this installation" in capsys.readouterr().err


# --------------------------------------------------- end to end, subprocesses


def run_cmd(cmd, tmp_path, timeout=240, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ENV}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)


def results(proc):
    found = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert found, f"no RESULT line\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("level,half", [("O1", "bfloat16"), ("O2", "float16")])
def test_apex_script_runs_unmodified_under_the_launcher(tmp_path, level, half):
    ckpt = tmp_path / "ckpt.pt"
    script = SCRIPTS / "apex_style.py"
    proc = run_cmd([sys.executable, "-m", "amp_patch", "run", "--half-dtype", half, str(script), str(ckpt), "--opt-level", level], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (r,) = results(proc)
    # The script's own amp.initialize ran, at its own opt level, in the launcher's dtype.
    assert r["linear_dtypes"] == {"fc1": f"torch.{half}", "fc2": f"torch.{half}"}
    assert r["finite"] and r["amp_module"] == "amp_patch.amp"
    if half == "float16":  # Apex's dynamic scaler: 2**16 to start, 4 clean steps
        assert r["amp_state"]["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 4}
    else:  # BF16 needs no scaling
        assert r["amp_state"]["loss_scaler0"]["loss_scale"] == 1.0
    assert r["reloaded"] and r["weight_dtype"] == "torch.float32"  # checkpoints hold FP32 weights
    assert proc.stderr.count("resolves to amp_patch.amp") == 1


@pytest.mark.slow
def test_plain_fp32_script_trains_in_fp16_and_keeps_its_exit_code(tmp_path):
    exe = shutil.which("amp-patch")
    cmd = [exe] if exe else [sys.executable, "-m", "amp_patch"]
    script = SCRIPTS / "plain_fp32.py"
    proc = run_cmd([*cmd, "run", str(script), "--steps", "3", "--exit", "3"], tmp_path, AMP_PATCH_HALF_DTYPE="float16")
    assert proc.returncode == 3, proc.stderr
    (r,) = results(proc)
    assert r["linear_dtypes"] == {"fc1": "torch.float16", "fc2": "torch.float16"}
    assert r["weight_dtype"] == "torch.float32" and r["grad_dtype"] == "torch.float32"  # O1: FP32 model
    assert all(abs(v) < 10 for v in r["losses"]) and r["losses"][-1] < r["losses"][0]
    assert r["name"] == "__main__" and r["file"] == str(script)
    assert r["argv"][1:] == ["--steps", "3", "--exit", "3"] and r["path0"] == str(SCRIPTS)


@pytest.mark.slow
def test_script_traceback_and_exit_code_pass_through_in_a_subprocess(tmp_path):
    script = SCRIPTS / "plain_fp32.py"
    proc = run_cmd([sys.executable, "-m", "amp_patch", "run", str(script), "--steps", "1", "--raise"], tmp_path)
    plain = run_cmd([sys.executable, str(script), "--steps", "1", "--raise"], tmp_path)
    assert proc.returncode == plain.returncode == 1
    tb = proc.stderr[proc.stderr.index("Traceback"):].splitlines()
    expected = plain.stderr[plain.stderr.index("Traceback"):].splitlines()
    assert tb == expected  # the same frames, lines and message as `python script.py`
    assert tb[-1] == "RuntimeError: boom from the training script"


LIFETIME_UTIL = """
class Last:
    def __del__(self):
        print("freed", flush=True)
"""
# The class lives in a module of its own: one defined in the script would tie
# the script's globals into a reference cycle, freed only by the collector.
LIFETIME_SCRIPT = """
import atexit, sys
from lifetime_util import Last
atexit.register(print, "atexit", flush=True)
keep = Last()
print("end of script", flush=True)
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "raise":
    raise RuntimeError("boom")
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "exit", "raise"])
def test_script_globals_live_until_exit_as_under_python(tmp_path, ending):
    # Python frees a script's globals only as the interpreter shuts down,
    # after atexit; freeing them earlier ran a DDP model's process-group
    # destructor right after the script's last line (a gloo deadlock).
    script = tmp_path / "lifetime.py"
    script.write_text(LIFETIME_SCRIPT)
    (tmp_path / "lifetime_util.py").write_text(LIFETIME_UTIL)
    plain = run_cmd([sys.executable, str(script), ending], tmp_path)
    proc = run_cmd([sys.executable, "-m", "amp_patch", "run", str(script), ending], tmp_path)
    assert plain.stdout.splitlines() == ["end of script", "atexit", "freed"]
    assert proc.stdout.splitlines() == plain.stdout.splitlines()
    assert proc.returncode == plain.returncode == {"return": 0, "exit": 3, "raise": 1}[ending]


@pytest.mark.slow
def test_torchrun_runs_a_ddp_script_under_the_launcher(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    proc = run_cmd(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "amp_patch", "run", str(SCRIPTS / "ddp_train.py")],
        tmp_path, timeout=300, AMP_PATCH_OPT_LEVEL="O1", OMP_NUM_THREADS="1",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = sorted(results(proc), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == [0, 1] and all(r["world"] == 2 for r in found)
    for r in found:
        assert set(r["linear_dtypes"].values()) == {"torch.bfloat16"}
        assert r["ranks_identical"]


def test_lists_names_the_op_an_inplace_form_follows(capsys):
    assert cli.main(["lists", "--half-dtype", "float16", "--device", "cuda"]) == 0
    rows = {tuple(line.split()[:2]): line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    exp = oplists.load().resolve(torch.float16, "cuda")[("torch.Tensor", "exp")]
    assert rows[("torch.Tensor", "exp_")].split()[2:] == ["float", "default", exp.source, "in-place", "form", "of", "exp"]


# ------------------------------------------------ what the launcher says it did


TRAIN = """\
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).float().pow(2).mean().backward()
    opt.step()
"""


def _ours(err):
    return [line for line in err.splitlines() if line.startswith("amp-patch run: ")]


@pytest.mark.quick
def test_run_says_what_it_turned_on_and_what_ran(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "bfloat16")
    script = write(tmp_path, "train.py", TRAIN)
    assert cli.main(["run", "--opt-level", "O1", str(script)]) == 0
    banner, summary = _ours(capsys.readouterr().err)
    assert banner == ("amp-patch run: O1 (from --opt-level; torch functions cast), half dtype bfloat16 (from "
                      "AMP_PATCH_HALF_DTYPE), no loss scaling (static 1.0, bfloat16 needs none)")
    table = oplists.load().resolve(torch.bfloat16, "cpu")
    n = len(table)
    assert summary.startswith(
        "amp-patch run: done: O1 in bfloat16, set by the launcher; 3 steps taken, 0 skipped; final loss scale 1 "
        f"(static); ops cast: {n} torch functions patched (")
    counts = dict(part.rsplit(" ", 1) for part in summary[summary.rindex("(") + 1:-1].split(", "))
    assert {k: int(v) for k, v in counts.items()} == {
        p: sum(1 for e in table.values() if e.policy == p) for p in {e.policy for e in table.values()}}


def test_run_names_defaults_and_the_scripts_own_initialize(tmp_path, capsys):
    script = write(tmp_path, "apex_train.py", """\
        import torch
        from apex import amp
        torch.manual_seed(0)  # an unlucky draw overflows FP16 at the first scale, skipping a step
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    """)
    assert cli.main(["run", "--half-dtype", "float16", "--loss-scale", "dynamic", str(script)]) == 0
    banner, summary = _ours(capsys.readouterr().err)
    assert banner == ("amp-patch run: O1 (default; torch functions cast), half dtype float16 (from --half-dtype), "
                      "dynamic loss scaling (from --loss-scale); apex_train.py:6 calls amp.initialize itself, and "
                      "its opt level and loss scale replace these from there")
    assert summary == ("amp-patch run: done: O2 in float16, set by the script's own initialize; 2 steps taken, "
                       "0 skipped; final loss scale 65536 (dynamic); ops cast: none patched, the model itself is float16")


@pytest.mark.quick
def test_run_quiet_says_nothing_of_its_own(tmp_path, capsys):
    script = write(tmp_path, "train.py", TRAIN)
    assert cli.main(["run", "--quiet", "--opt-level", "O4", str(script)]) == 0
    assert _ours(capsys.readouterr().err) == []
    assert cli.main(["run", "--opt-level", "O0", str(script)]) == 0
    assert _ours(capsys.readouterr().err) == ["amp-patch run: O0 (from --opt-level; FP32, nothing cast)",
                                              "amp-patch run: done: no mixed-precision run (nothing to do at O0)"]


def test_run_summary_comes_before_the_scripts_exit(tmp_path, capsys):
    script = write(tmp_path, "leave.py", TRAIN + "import sys\nsys.exit(4)\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--opt-level", "O4", str(script)])
    assert info.value.code == 4
    assert _ours(capsys.readouterr().err)[1].startswith("amp-patch run: done: O4 in bfloat16, set by the launcher; 3 steps taken")


@pytest.mark.quick
def test_version_names_amp_patch_torch_python_and_the_fast_path(capsys):
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"amp-patch {amp_patch.__version__} ({os.path.dirname(amp_patch.__file__)})"
    assert lines[1].startswith(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    assert lines[2].startswith("the C fast path is in use" if amp_patch.patching.wrappers.fast else "the C fast path is not in use")
    cfg = (REPO / "setup.cfg").read_text()
    assert f"version = {amp_patch.__version__}\n" in cfg  # one version, said twice
