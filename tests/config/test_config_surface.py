"""What the docs and the command line say about options, levels and Apex's
modules is what ``amp_patch.config`` and ``amp_patch.apex.standins`` hold:
each is written once and the rest is derived from, or held to, it."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import amp_patch
from amp_patch import config
from amp_patch.apex.standins import REPLACEMENTS, STANDINS
from amp_patch.config import presets
from amp_patch.frontends import cli

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "README.md").is_file())
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _table_after(header: str) -> list:
    start = README.index(header)
    rows = []
    for line in README[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_readme_opt_level_table_is_the_presets():
    assert presets.readme_table() in README


def test_every_preset_reads_back_from_parse():
    for level, p in config.PRESETS.items():
        c = config.parse(level, "cuda", half_dtype="float16")
        assert c.opt_level == level and c.patch_torch_functions == p.patch_torch_functions
        assert c.master_weights == p.master_weights and c.keep_batchnorm_fp32 == p.keep_batchnorm_fp32
        assert (c.cast_model_type is not None) == (p.cast_model_type is not None)
        assert level in config.FUNCTION_LEVELS if p.patch_torch_functions else level not in config.FUNCTION_LEVELS


def test_every_option_is_documented_in_initialize_or_the_readme():
    doc = inspect.getdoc(amp_patch.initialize)
    missing = [name for name in config.OPTIONS if f"``{name}``" not in doc and f"    {name}:" not in doc]
    assert missing == []


def test_the_readme_option_table_names_only_options():
    named = [n for row in _table_after("| option of `initialize` |") for n in re.findall(r"`(\w+)`", row[0])]
    assert named and [n for n in named if n not in config.OPTIONS] == []


def test_an_unknown_option_lists_the_options_from_the_config():
    with pytest.raises(amp_patch.ConfigError) as e:
        config.parse("O1", "cpu", growth_factr=3.0)
    msg = str(e.value)
    assert "did you mean 'growth_factor'?" in msg
    assert all(name in msg for name in config.EXTRA_OPTIONS) and all(name in msg for name in config.OVERRIDES)


def test_scopes_partition_the_options():
    scopes = [config.config.scoped(s) for s in ("level", "session", "call")]
    flat = [n for s in scopes for n in s]
    assert len(flat) == len(set(flat))
    assert set(flat) == set(config.OPTIONS) | {"opt_level"}
    assert config.SESSION_WIDE == scopes[1] and config.PER_CALL == scopes[2]


def test_run_help_lists_every_level_from_the_presets(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for level, p in config.PRESETS.items():
        assert f"{level}: {p.does}" in out


def test_the_readme_apex_table_is_the_standins():
    rows = _table_after("| Apex module | served by amp_patch |")
    served = [r for r in rows if r[1].startswith("served")]
    not_served = [r for r in rows if r[1].startswith("not served")]
    assert served and not_served

    def first_names(cell):
        head = cell.split("(")[0]
        return re.findall(r"`((?:apex\.)?\w+)`", head)

    for r in served:
        for name in first_names(r[0]):
            if name.startswith("apex."):
                assert name in STANDINS, f"README says {name} is served; apex/standins.py does not serve it"
    extensions = next(r for r in served if r[0].startswith("extensions"))
    listed = set(re.findall(r"`(\w+)`", extensions[0]))
    served_ext = {n for n, to in STANDINS.items() if "." not in n and to.startswith("amp_patch.")}
    assert served_ext <= listed, f"served extensions the README does not list: {served_ext - listed}"
    for r in not_served:
        for name in first_names(r[0]):
            if name.startswith("apex."):
                assert name not in STANDINS or "internals" in r[0], name
                assert any(name == k or name.startswith(k + ".") for k in REPLACEMENTS), name
