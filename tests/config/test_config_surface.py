"""What the docs and the command line say about options, levels and Apex's
modules is what ``amp_patch.config`` and ``amp_patch.apex.standins`` hold:
each is written once and the rest is derived from, or held to, it."""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import amp_patch
from amp_patch import config
from amp_patch.apex.standins import REPLACEMENTS, STANDINS
from amp_patch.config import presets
from amp_patch.frontends import cli
from docs_text import docs_text, read, section

DOCS = docs_text()


def _table_after(header: str, text: str = DOCS) -> list:
    start = text.index(header)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_readme_opt_level_table_is_the_presets():
    assert presets.readme_table() in read("README.md")


def test_every_preset_reads_back_from_parse():
    for level, p in config.PRESETS.items():
        c = config.parse(level, "cuda", half_dtype="float16")
        assert c.opt_level == level and c.patch_torch_functions == p.patch_torch_functions
        assert c.master_weights == p.master_weights and c.keep_batchnorm_fp32 == p.keep_batchnorm_fp32
        assert (c.cast_model_type is not None) == (p.cast_model_type is not None)
        assert level in config.FUNCTION_LEVELS if p.patch_torch_functions else level not in config.FUNCTION_LEVELS


def test_every_option_is_documented_in_initialize_or_the_docs():
    doc = inspect.getdoc(amp_patch.initialize)
    missing = [name for name in config.OPTIONS if f"``{name}``" not in doc and f"    {name}:" not in doc]
    assert missing == []


def test_the_docs_option_table_names_only_options():
    named = [n for row in _table_after("| option of `initialize` |") for n in re.findall(r"`(\w+)`", row[0])]
    assert named and [n for n in named if n not in config.OPTIONS] == []


def _reference_rows() -> dict:
    """``{option: (default, scope)}`` from every table of the reference's option section."""
    text = section("`initialize` options", "docs/reference.md")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_the_reference_lists_every_option_once_with_its_scope():
    rows = _reference_rows()
    assert sorted(rows) == sorted(("opt_level",) + config.OPTIONS)
    scopes = {f.name: f.metadata["scope"] for cls in (config.AmpConfig, config.ScalerConfig)
              for f in dataclasses.fields(cls) if "scope" in f.metadata}
    assert {n: s for n, (_, s) in rows.items()} == {n: scopes[n] for n in rows}


def test_the_reference_gives_each_plain_default_the_code_has():
    """A default the reference writes as one literal (`20`, `True`, `"auto"`) is the field's default."""
    fields = {f.name: f.default for cls in (config.AmpConfig, config.ScalerConfig)
              for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    literal = {"True": True, "False": False, "None": None, "2**16": 2.0**16, "2**24": 2.0**24}
    for option, (default, _) in _reference_rows().items():
        m = re.fullmatch(r"`([^`]+)`", default)
        if m is None or option not in fields:
            continue  # a default that depends on the level or the device, said in words
        value = m.group(1)
        expected = fields[option]
        if value in literal:
            assert literal[value] == expected, option
        elif value.startswith('"'):
            assert value.strip('"') == expected, option
        elif value.startswith("torch."):
            assert str(expected) == value, option
        else:
            assert float(value) == expected, option


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
        assert cli._level_help(level) in out and p.does in out
    # O4/O5 are said to be the BF16 forms of O1/O2
    assert "O4: the BF16 form of O1" in out and "O5: the BF16 form of O2" in out


def test_the_docs_apex_table_is_the_standins():
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
                assert name in STANDINS, f"the docs say {name} is served; apex/standins.py does not serve it"
    extensions = next(r for r in served if r[0].startswith("extensions"))
    listed = set(re.findall(r"`(\w+)`", extensions[0]))
    served_ext = {n for n, to in STANDINS.items() if "." not in n and to.startswith("amp_patch.")}
    assert served_ext <= listed, f"served extensions the docs do not list: {served_ext - listed}"
    for r in not_served:
        for name in first_names(r[0]):
            if name.startswith("apex."):
                assert name not in STANDINS or "internals" in r[0], name
                assert any(name == k or name.startswith(k + ".") for k in REPLACEMENTS), name
