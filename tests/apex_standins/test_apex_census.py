"""The census of real Apex-era code (tests/data/apex_census.json): every import
statement and every name each file uses, replayed through the apex alias on
live objects, and check-script's verdict on the same name, which must agree."""
from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch import amp as amp_patch_amp
from amp_patch.frontends import alias, scan

CENSUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "apex_census.json").read_text())["files"]
IDS = [f"{e['repo']}:{e['path']}@{e['commit'][:8]}" for e in CENSUS]
TOKEN = re.compile(r"\.(\*|[A-Za-z_]\w*)|(\[\])|(\(\))|\((\w+)=\)|( =)$")


def parse(name):
    """``(root, steps)`` of a census name, in check-script's notation."""
    root = re.match(r"[A-Za-z_]\w*", name).group(0)
    steps, pos = [], len(root)
    for m in TOKEN.finditer(name, pos):
        assert m.start() == pos, f"{name!r} does not parse at {pos}"
        attr, item, call, kw, store = m.groups()
        steps.append(("attr", attr) if attr else ("item",) if item else ("call",) if call
                     else ("kw", kw) if kw else ("store",))
        pos = m.end()
    assert pos == len(name), f"{name!r} does not parse at {pos}"
    return root, steps


def _params(dtype=torch.float32):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3, dtype=dtype)), nn.Parameter(torch.randn(3, dtype=dtype))]


def _factories():
    """Live instances of the Apex classes whose instances census chains go through."""
    from amp_patch.apex import fp16_utils, optimizers
    from amp_patch.apex.contrib import optimizers as contrib_optimizers

    return {
        optimizers.FusedAdam: lambda: optimizers.FusedAdam(_params()),
        optimizers.FusedLAMB: lambda: optimizers.FusedLAMB(_params()),
        optimizers.FusedSGD: lambda: optimizers.FusedSGD(_params(), lr=0.1),
        optimizers.FP16_Optimizer: lambda: optimizers.FP16_Optimizer(
            optimizers.FusedAdam(_params(torch.float16), max_grad_norm=1.0), dynamic_loss_scale=True),
        contrib_optimizers.FP16_Optimizer: lambda: contrib_optimizers.FP16_Optimizer(
            contrib_optimizers.FusedAdam(_params(torch.float16))),
        fp16_utils.FP16_Optimizer: lambda: fp16_utils.FP16_Optimizer(
            torch.optim.SGD(_params(torch.float16), lr=0.1), dynamic_loss_scale=True, verbose=False),
    }


_PROBE = object()


def replay(name):
    """None when ``name`` resolves on live objects through the alias, else the error.

    Attributes are read as a script reads them (on a module, a missing
    attribute is imported as a submodule, as ``from a import b`` does); a
    subscript takes element 0; a call of a class with a factory makes an
    instance, any other call ends the walk (its value is the script's);
    a keyword must be in the signature; a set attribute must be settable.
    """
    root, steps = parse(name)
    try:
        obj = importlib.import_module(root)
    except ImportError as e:
        return str(e)
    apex_name, factories = root, _factories()
    for i, step in enumerate(steps):
        kind = step[0]
        if kind == "attr" and step[1] == "*":
            missing = [n for n in getattr(obj, "__all__", []) if not hasattr(obj, n)]
            return f"{apex_name}.__all__ names missing {missing}" if missing else None
        if kind == "attr" and i + 1 < len(steps) and steps[i + 1][0] == "store":
            current = getattr(obj, step[1], _PROBE)
            try:
                setattr(obj, step[1], current)
            except (AttributeError, TypeError) as e:
                return str(e)
            if current is _PROBE:
                delattr(obj, step[1])
            return None
        if kind == "attr":
            try:
                obj = getattr(obj, step[1])
            except AttributeError as e:
                if not isinstance(obj, types.ModuleType):
                    return str(e)
                try:
                    obj = importlib.import_module(f"{apex_name}.{step[1]}")
                except ImportError as e2:
                    return str(e2)
            apex_name = f"{apex_name}.{step[1]}"
        elif kind == "item":
            if not isinstance(obj, (list, tuple)) or not obj:
                return None
            obj = obj[0]
        elif kind == "call":
            if obj not in factories:
                return None
            obj = factories[obj]()
        elif kind == "kw":
            params = inspect.signature(obj).parameters.values()
            if step[1] not in {p.name for p in params} and not any(p.kind is p.VAR_KEYWORD for p in params):
                return f"{apex_name} takes no keyword {step[1]!r}"
            return None
    return None


def synthesized(name):
    """A two-line script that uses ``name`` as the census file did: its import, then the use."""
    root, steps = parse(name)
    if steps and steps[-1] == ("attr", "*"):
        module = ".".join([root] + [s[1] for s in steps[:-1]])
        return f"from {module} import *\n"
    expr = root
    for step in steps:
        kind = step[0]
        expr += (f".{step[1]}" if kind == "attr" else "[0]" if kind == "item" else "()" if kind == "call"
                 else f"({step[1]}=None)" if kind == "kw" else " = None")
    return f"import {root}\n{expr}\n"


def static_verdict(name):
    uses = {u.name: u for u in scan.scan(synthesized(name))}
    assert name in uses, f"check-script reads {synthesized(name)!r} as {sorted(uses)}, not {name!r}"
    return uses[name]


@pytest.fixture
def alias_run(apex_alias, monkeypatch):
    """The alias installed (no apex anywhere before or after) and an O1 run
    going, so chains through ``amp._amp_state`` read a live session."""
    monkeypatch.setattr(amp_patch_amp, "_enabled", None)
    model = nn.Linear(3, 2)
    amp_patch_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                             half_dtype=torch.float16, verbosity=0)
    yield
    amp_patch.deinitialize()
    amp_patch_amp.lists.reset()


def test_the_census_is_real_code_from_many_repos_and_years():
    repos = {e["repo"] for e in CENSUS}
    years = {e["date"][:4] for e in CENSUS}
    assert len(CENSUS) >= 40 and len(repos) >= 25
    assert years <= {"2018", "2019", "2020", "2021", "2022", "2023", "2024"} and {"2018", "2019", "2024"} <= years
    assert len({(e["repo"], e["path"], e["commit"]) for e in CENSUS}) == len(CENSUS)
    for e in CENSUS:
        assert re.fullmatch(r"[0-9a-f]{40}", e["commit"]) and e["imports"] and e["names"]
        for name in e["names"]:
            parse(name)


@pytest.mark.parametrize("entry", CENSUS, ids=IDS)
def test_every_import_of_the_census_runs_or_names_the_replacement(entry, alias_run):
    for stmt in entry["imports"]:
        namespace = {"importlib": importlib}
        try:
            if stmt.startswith("importlib."):  # `x = importlib.import_module("fused_adam_cuda")`
                namespace["_m"] = eval(stmt, namespace)
            else:
                exec(stmt, namespace)
        except ImportError as e:
            # what the alias does not serve says what to use instead
            assert re.search(r"\b[Uu]se \S", str(e)), f"{stmt}: {e}"
            continue
        bound = {k: v for k, v in namespace.items() if k not in ("importlib", "__builtins__")}
        assert bound, stmt
        for value in bound.values():
            module = value if isinstance(value, types.ModuleType) else inspect.getmodule(value)
            if value is sys.modules.get("apex"):
                assert isinstance(value.__spec__.loader, type(alias._finder)), stmt  # the stand-in package
            elif module is not None and not isinstance(value, (list, dict)):
                assert module.__name__.startswith(("amp_patch", "torch")), f"{stmt}: {value!r} is not a stand-in"


@pytest.mark.parametrize("entry", CENSUS, ids=IDS)
def test_check_script_agrees_with_what_resolves_name_by_name(entry, alias_run):
    for name in entry["names"]:
        error = replay(name)
        use = static_verdict(name)
        if error is None:
            assert use.served_by is not None, f"{name} resolves through the alias, but check-script says: {use.hint}"
        else:
            assert use.served_by is None, f"{name} fails through the alias ({error}), but check-script says served"
            assert use.hint, name


def test_census_summary_what_is_served(alias_run):
    # the state of the census, kept honest: most names and most files resolve, and the
    # names that do not are the ones amp_patch does not serve on purpose
    names = [n for e in CENSUS for n in e["names"]]
    failing = sorted({n for n in names if replay(n) is not None})
    whole = [e for e in CENSUS if all(replay(n) is None for n in e["names"])]
    assert len(whole) >= 58, failing
    expected_gaps = ("apex.transformer", "apex.RNN", "._amp_stash", "._lazy_init_maybe_master_weights",
                     "apex.amp.__path__", "distributed_fused_adam._")
    assert all(any(g in n for g in expected_gaps) for n in failing), failing
