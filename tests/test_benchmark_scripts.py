"""The benchmark scripts write files only when asked (``--write``, or a path
given for the file), and what they print and the docs say of them names
what each section measures, nothing else."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from docs_text import doc_files, read
from docs_text import name as doc_name

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    path = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path  # suite.py puts benchmarks/ first to import its workloads
    return mod


@pytest.fixture(scope="module")
def suite():
    return _load("suite")


@pytest.fixture(scope="module")
def conv():
    return _load("convergence")


def _fake_workload(workload, modes, device, half, rounds, block_s, scale, threads):
    """What run_workload returns, for modes without autocast (the cast_policy section's command)."""
    nan = float("nan")
    return {"flops": 1e9, "block": 3, "rounds": [{m: 0.01 for m in modes}],
            "modes": {m: {"step_s": 0.01, "wall_s": 0.01, "ratio_autocast": nan, "ratio_iqr": (nan, nan),
                          "loss": 1.0, "mem_mb": 10.0, "syncs": nan, "speedup_fp32": 1.0} for m in modes}}


@pytest.fixture
def fake_suite(suite, monkeypatch):
    monkeypatch.setattr(suite, "run_workload", _fake_workload)
    monkeypatch.setattr(suite, "gemm_peak", lambda *a, **k: 1e12)
    writes = []
    real = suite.write_results
    monkeypatch.setattr(suite, "write_results", lambda path, key, body: (writes.append(path), real(path, key, body)))
    return writes


#: --threads as they are: the suite sets torch's thread count to it
ARGS = ["--workloads", "smallops", "--modes", "fp32", "O1-auto", "--device", "cpu", "--no-assert",
        "--threads", str(torch.get_num_threads())]


def test_the_suite_writes_nothing_unless_asked(suite, fake_suite, capsys, tmp_path):
    suite.main(ARGS)
    out = capsys.readouterr().out
    assert fake_suite == []  # benchmarks/RESULTS.md untouched
    assert "nothing written (--write puts the table into its block of benchmarks/RESULTS.md)" in out
    # no autocast among the modes: no ratio to it, shown as such rather than as nan
    row = next(line for line in out.splitlines() if line.startswith("| smallops | O1-auto |"))
    assert "nan" not in row.split("|")[6] and row.split("|")[6].strip() == "-"
    suite.main(ARGS + ["--no-write"])  # the old flag is still accepted
    assert fake_suite == []
    target = tmp_path / "out.md"
    suite.main(ARGS + ["--output", str(target)])  # a path given: written there
    assert fake_suite == [str(target)] and "<!-- suite-cpu -->" in target.read_text()
    with pytest.raises(SystemExit):
        suite.main(ARGS + ["--write", "--no-write"])
    assert "contradict" in capsys.readouterr().err


def test_the_suite_writes_results_md_with_write(suite, fake_suite, monkeypatch, tmp_path):
    monkeypatch.setattr(suite, "HERE", tmp_path)  # the default output, moved off the tracked file
    suite.main(ARGS + ["--write"])
    assert fake_suite == [str(tmp_path / "RESULTS.md")]
    assert "Command: `python benchmarks/suite.py" in (tmp_path / "RESULTS.md").read_text()


def _runs():
    out = []
    for level, loss in (("FP32", 0.1), ("O4", 0.1)):
        out.append({"task": "digits", "level": level, "seed": 0, "half_dtype": "bfloat16" if level == "O4" else "float32",
                    "eval_accuracy": 97.0, "eval_loss": loss, "skipped": 0, "wall_s": 1.0, "cpu_s": 1.0,
                    "curve": {"step": [1, 2], "train_loss": [2.0, loss], "eval_loss": [2.0, loss],
                              "eval_accuracy": [10.0, 97.0]}})
    return out


def test_convergence_writes_its_tracked_files_only_with_write(conv, monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": {"machine": "test"}, "runs": _runs()}))
    home = tmp_path / "benchmarks"
    home.mkdir()
    monkeypatch.setattr(conv, "HERE", home)  # where the tracked JSON and PNG live
    assert conv.main(["--from-json", str(saved), "--markdown"]) == 0
    assert "| digits | O4 | BF16 |" in capsys.readouterr().out
    assert list(home.iterdir()) == []  # the table again, no PNG drawn over the tracked one
    assert conv.main(["--from-json", str(saved), "--write"]) == 0
    assert (home / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        conv.main(["--resume"])
    assert "--resume keeps the runs of a JSON file" in capsys.readouterr().err


ISSUE = re.compile(r"\bissues? \d+", re.I)


def test_no_issue_numbers_in_the_docs_the_benchmarks_or_results_headings():
    texts = {doc_name(p): read(p) for p in doc_files()}
    texts.update({f"benchmarks/{p.name}": p.read_text(encoding="utf-8") for p in sorted(BENCH.glob("*.py"))})
    results = (BENCH / "RESULTS.md").read_text(encoding="utf-8")
    texts["benchmarks/RESULTS.md headings"] = "\n".join(re.findall(r"^#+ .*$", results, flags=re.M))
    found = [f"{where}: {m.group(0)}" for where, text in texts.items() for m in ISSUE.finditer(text)]
    assert found == []


def test_the_phase_benchmark_splits_each_mode_s_step_and_writes_nothing(capsys, tmp_path, monkeypatch):
    """``benchmarks/phases.py`` times forward, backward and step apart for every
    mode, each ratio against autocast's phase, prints the table, and writes no file;
    ``--around-gemms`` adds a second table, of each phase's time outside the GEMMs."""
    monkeypatch.chdir(tmp_path)
    phases = _load("phases")
    phases.main(["--scale", "0.05", "--rounds", "2", "--steps", "1", "--around-gemms"])
    out = capsys.readouterr().out
    timed, around = out.split("outside the GEMMs")
    for table in (timed, around):
        assert "| mode | forward | backward | step | whole step |" in table
        rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "x)" in line}
        assert sorted(rows) == sorted(phases.MODES)
        assert rows["autocast"].count("(1.00x)") == 4  # each phase against itself
    assert not list(tmp_path.iterdir())


def test_time_outside_the_gemms_leaves_out_exactly_the_gemm_ops():
    """What ``--around-gemms`` subtracts: an FP32 step's forward outside its GEMMs is
    far below its whole forward on a model made of matmuls, and nothing is negative."""
    phases = _load("phases")
    mode = phases.Mode("fp32", "simplenet", 0.25, torch.bfloat16)
    try:
        whole = mode.steps(2, warm=1)
        rest = mode.around_gemms(2)
    finally:
        mode.close()
    assert set(rest) == set(phases.PHASES)
    assert all(v > 0 for v in rest.values())
    assert rest["forward"] < 0.5 * whole["forward"]  # the addmms are most of it


def _op_rows(out: str) -> dict:
    """op_diff's table rows, by op: (calls A, calls B, ms A, ms B, MB A, MB B)."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = tuple(float(c) for c in cells[1:])
    return rows


def test_the_op_diff_of_a_mode_against_itself_is_empty(capsys, tmp_path, monkeypatch):
    """``benchmarks/op_diff.py`` lists only the ops two modes call differently: a mode
    against itself lists none, and the totals agree; it writes no file."""
    monkeypatch.chdir(tmp_path)
    op_diff = _load("op_diff")
    assert op_diff.main(["--workload", "smallops", "--modes", "O1", "O1", "--warmup", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert _op_rows(out) == {}
    total = next(line for line in out.splitlines() if line.startswith("| **all aten ops**"))
    cells = [c.strip() for c in total.split("|")[1:-1]]
    assert cells[1] == cells[2] and cells[5] == cells[6] and float(cells[1]) > 100  # calls, bytes
    assert not list(tmp_path.iterdir())


def test_the_op_diff_shows_o1_casting_no_more_than_autocast(capsys):
    """On the GPT workload O1 moves exactly the bytes autocast's casts move (the same
    casts), and what it calls less of is the optimizer's update (momentum's ``mul_``/
    ``add_``, which the one-pass step does in C where it is built)."""
    op_diff = _load("op_diff")
    op_diff.main(["--workload", "gpt", "--scale", "0.25", "--modes", "autocast", "O1", "--warmup", "2", "--steps", "1"])
    rows = _op_rows(capsys.readouterr().out)
    casts = rows.get("aten::_to_copy")
    assert casts is None or casts[4] == casts[5]  # the same megabytes cast, if listed at all
    from amp_patch.precision import onepass
    if onepass.native is not None:
        assert rows["aten::mul_"][0] > rows["aten::mul_"][1]
    else:  # torch's own SGD step in both
        assert "aten::mul_" not in rows
