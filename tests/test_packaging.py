"""The op lists ship inside the package: found after `pip install .`, after
`pip install -e .` (this test environment) and from a built wheel. Where a C
compiler is, each install builds the C fast path (``amp_patch.patching._fastpath``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import HAS_C_COMPILER

ROOT = Path(__file__).resolve().parents[1]
#: every default list in the checkout; each must reach the wheel
LIST_FILES = sorted(p.name for p in (ROOT / "lists").glob("*.yaml"))
PROBE = (
    "import amp_patch, amp_patch.oplists as L, sys; "
    "names = [n for n, _ in L.default_files()]; "
    "print(amp_patch.__file__); print(len(L.load().entries), sorted(names)); "
    "import amp_patch.patching.wrappers as W; print('fastpath', W.fast.__file__ if W.fast else W.FAST_UNAVAILABLE)"
)


def _assert_fast_path_in(out: str, site: Path) -> None:
    line = next(x for x in out.splitlines() if x.startswith("fastpath "))
    if HAS_C_COMPILER:
        assert line.startswith(f"fastpath {site}"), f"the install did not build the C fast path: {line}"


def _source_copy(tmp_path: Path) -> Path:
    # Build from a copy so no build/ or egg-info lands in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    # The checkout's own build of the extension stays behind: each install builds it.
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(ROOT / "amp_patch", src / "amp_patch", ignore=ignore)
    shutil.copytree(ROOT / "lists", src / "lists", ignore=ignore)
    return src


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "-q", *args]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


#: the editable install's finder would serve, from the checkout, any module an install left out
NO_EDITABLE_FINDER = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "


def _probe(site: Path, tmp_path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(site))
    # Run from an empty folder so the checkout's amp_patch/ cannot shadow the install.
    res = subprocess.run([sys.executable, "-c", NO_EDITABLE_FINDER + PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """One wheel built from a copy of the checkout, for every test that installs it
    (each build compiles the C parts: seconds of CI's time)."""
    where = tmp_path_factory.mktemp("wheel")
    src = _source_copy(where)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(where / "dist"), ".", cwd=src)
    return next((where / "dist").glob("amp_patch-*.whl"))


@pytest.mark.slow
def test_wheel_contains_lists_and_loads_them(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for f in LIST_FILES:
        assert f"amp_patch/lists/{f}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), str(wheel), cwd=tmp_path)
    out = _probe(site, tmp_path)
    assert str(site) in out and "torch.nn.functional.yaml" in out
    for ext in ("amp_patch/patching/_fastpath", "amp_patch/precision/_onepass"):  # both optional C parts
        assert any(n.startswith(ext) and n.endswith((".so", ".pyd")) for n in names) or not HAS_C_COMPILER, ext
    _assert_fast_path_in(out, site)


@pytest.mark.slow
def test_plain_pip_install_finds_lists(tmp_path):
    src = _source_copy(tmp_path)
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-build-isolation", "--target", str(site), ".", cwd=src)
    out = _probe(site, tmp_path)
    assert str(site) in out and "torch.Tensor.yaml" in out
    _assert_fast_path_in(out, site)


def test_editable_install_finds_lists_in_the_checkout():
    # The test environment is the editable install (`pip install -e .`).
    from importlib import resources

    import amp_patch.oplists as L

    root = resources.files("amp_patch.lists")
    assert Path(str(root)).resolve() == (ROOT / "lists").resolve()
    assert len(L.load().entries) > 200
    assert [n for n, _ in L.default_files()] == LIST_FILES


def test_a_checkout_on_pythonpath_without_installing_finds_the_lists(tmp_path):
    # A copy of the checkout that was never installed: amp_patch comes from
    # PYTHONPATH, and the editable install's finder is taken out of the way.
    src = _source_copy(tmp_path)
    probe = NO_EDITABLE_FINDER + PROBE
    env = dict(os.environ, PYTHONPATH=str(src), AMP_PATCH_PURE_PYTHON="1")
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(str(src / "amp_patch"))
    assert "torch.Tensor.yaml" in res.stdout and "torch.nn.functional.yaml" in res.stdout


def _package_imports():
    """``{module: {module it imports at run time}}`` over amp_patch, and the
    imports made inside functions. Imports under ``if TYPE_CHECKING:`` name
    types for readers and run never, so they are no edges."""
    import ast

    root = ROOT / "amp_patch"
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    edges, inside = {m: set() for m in mods}, []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        typing_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)
                       for n in ast.walk(f)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("amp_patch"):
                base = node.module
            else:
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                if target in mods and target != mod:
                    edges[mod].add(target)
                    if id(node) in in_function:
                        inside.append(f"{mod} -> {target}")
    return edges, inside


def _cycle(graph):
    state = {}

    def visit(u, path):
        state[u] = 1
        for v in graph.get(u, ()):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state:
                found = visit(v, path + [v])
                if found:
                    return found
        state[u] = 2
        return None

    for u in graph:
        if u not in state:
            found = visit(u, [u])
            if found:
                return found
    return None


#: the package's floors, lowest first: a module imports only from its own floor or lower ones
FLOORS = [
    {"base"},  # exceptions, the undo stack, the running-session slot, frames
    {"config"},  # AmpConfig and the opt-level presets
    # the mechanisms, each on its own floor: the op lists; the casting wrappers that
    # read them; diagnostics, which watch the wrappers; the model's precision (masters,
    # conversions, the one-pass step); loss scaling, which steps the masters
    {"oplists"},
    {"patching"},
    {"diagnostics"},
    {"precision"},
    {"scaling"},
    {"run"},  # the session and initialize's plan
    {"face"},  # the root's public modules: frontend, auto
    {"apex", "frontends"},  # Apex's API and the launcher, built on the public face
]
#: root modules that may stand anywhere: the package's re-exports, ``python -m`` and ``import amp_patch.auto`` (the launcher)
ENTRY_POINTS = {"amp_patch", "amp_patch.__main__", "amp_patch.auto"}


def _group(mod):
    parts = mod.split(".")
    if len(parts) > 1 and (ROOT / "amp_patch" / parts[1]).is_dir():
        return parts[1]
    # amp_patch.amp is apex.amp's API, built on the Apex stand-ins: it stands with them
    return "apex" if mod == "amp_patch.amp" else "face"


def test_imports_inside_the_package_go_one_way():
    edges, inside = _package_imports()
    assert not inside, f"imports inside functions: {inside}"
    assert _cycle(edges) is None, f"an import cycle between modules: {_cycle(edges)}"

    between = {}
    for a, targets in edges.items():
        for b in targets:
            if _group(a) != _group(b) and a not in ENTRY_POINTS:
                between.setdefault(_group(a), set()).add(_group(b))
    assert _cycle(between) is None, f"an import cycle between subpackages: {_cycle(between)}"


def test_each_floor_imports_only_from_itself_and_below():
    edges, _ = _package_imports()
    floor = {g: i for i, gs in enumerate(FLOORS) for g in gs}
    groups = {_group(m) for m in edges}
    assert groups <= set(floor), f"a subpackage with no floor: {groups - set(floor)}; add it to FLOORS"
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() if a not in ENTRY_POINTS
                    for b in targets if floor[_group(b)] > floor[_group(a)])
    assert upward == []


def test_the_root_holds_only_the_public_face():
    root = {p.stem for p in (ROOT / "amp_patch").glob("*.py")}
    # frontend: initialize and the rest; amp: Apex's API (apex.amp); auto: `import amp_patch.auto`
    assert root == {"__init__", "__main__", "frontend", "amp", "auto"}


def test_importing_amp_patch_does_not_import_dynamo():
    # torch._dynamo costs over a second of start-up, in every launcher subprocess too
    code = "import sys, amp_patch, amp_patch.amp; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_the_shipped_lists_are_parsed_once_per_process():
    import amp_patch.oplists as L
    from amp_patch.oplists import loading

    loading._shipped.cache_clear()
    first, second = L.load(), L.load()
    assert first.entries == second.entries
    assert loading._shipped.cache_info().misses == 1 and loading._shipped.cache_info().hits == 1


@pytest.mark.slow
def test_the_quick_run_reaches_every_subpackage(tmp_path):
    """``python -m pytest -q -m quick`` (the README's quick local run) runs code
    of every subpackage of amp_patch and of its public face (the shipped lists
    are data, which oplists' code loads)."""
    out = tmp_path / "ran.txt"
    env = dict(os.environ, AMP_PATCH_TRACE_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "quick", "-p", "quick_trace", "-p", "no:cacheprovider"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = {Path(p).resolve() for p in out.read_text().split()}
    package = ROOT / "amp_patch"
    reached = {p.relative_to(package).parts[0] if len(p.relative_to(package).parts) > 1 else "face"
               for p in ran if package in p.parents}
    subpackages = {d.name for d in package.iterdir() if (d / "__init__.py").exists()} | {"face"}
    assert subpackages - reached == set()
    nested = {d.relative_to(package).as_posix() for d in package.glob("*/*") if (d / "__init__.py").exists()}
    assert {n for n in nested if not any(package / n in p.parents for p in ran)} == set()  # apex.parallel, apex.fp16_utils


#: run by the fresh environment's interpreter, from an empty folder: where
#: amp_patch comes from, every module of it imported, one O1 and one O2 step
INSTALLED_PROBE = r'''
import importlib, json, math, pkgutil, sys, traceback
from pathlib import Path

checkout = Path(sys.argv[1]).resolve()
sources = [checkout / "amp_patch", checkout / "lists"]  # the checkout's code, not its .venv
import torch, amp_patch

def inside(p, folders):
    p = Path(p).resolve()
    return any(p == f or f in p.parents for f in folders)

report = {"file": amp_patch.__file__, "failed": {}}
report["finders"] = [repr(f) for f in sys.meta_path if "editable" in repr(f).lower()]

def failed(name):
    report["failed"][name] = traceback.format_exc(limit=3)

found = {"amp_patch"}
for info in pkgutil.walk_packages(amp_patch.__path__, "amp_patch.", onerror=failed):
    found.add(info.name)
for name in sorted(found):
    try:
        module = importlib.import_module(name)
    except Exception:
        failed(name)
    if name == "amp_patch.auto":  # importing it starts a session: undo that here
        module.session.stop()
report["modules"] = sorted(found)
files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
report["from_checkout"] = sorted(n for n, f in files.items() if f and inside(f, sources))
installed = Path(amp_patch.__file__).resolve().parent
report["elsewhere"] = sorted(n for n, f in files.items()
                             if n.split(".")[0] == "amp_patch" and f and not inside(f, [installed]))
report["path"] = [p for p in sys.path if p and (Path(p).resolve() == checkout or inside(p, sources))]

steps = {}
for level in ("O1", "O2"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp_patch.initialize(model, optimizer, opt_level=level)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    with amp_patch.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    steps[level] = {
        "out": str(out.dtype), "loss": loss.item(), "finite": math.isfinite(loss.item()),
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "masters": sorted({str(p.dtype) for p in amp_patch.master_params(optimizer)}),
        "moved": all(not torch.equal(a, b) for a, b in zip(before, model.parameters())),
    }
    amp_patch.deinitialize()
report["steps"] = steps
amp_patch.install_apex_alias()
from apex import amp
report["apex_amp"] = amp.__name__
print("REPORT " + json.dumps(report))
'''


def _checkout_modules() -> set:
    """Every module and package of the checkout that an install must hold: each
    ``.py`` under ``amp_patch/`` and the op lists' package (``lists/``)."""
    mods = set()
    for top, package in ((ROOT / "amp_patch", ["amp_patch"]), (ROOT / "lists", ["amp_patch", "lists"])):
        for path in top.rglob("*.py"):
            parts = package + list(path.relative_to(top).with_suffix("").parts)
            mods.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return mods


def _fresh_venv(where: Path) -> Path:
    """A new virtual environment that holds no amp_patch: no system site
    packages, and torch and the other dependencies reached through a ``.pth``
    file naming a folder of links into this environment's site-packages, which
    leaves out amp_patch, its editable finder and every ``.pth`` of ours."""
    import torch
    import wrapt
    import yaml

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    deps = where.parent / "deps"
    deps.mkdir()
    for source in {Path(m.__file__).resolve().parents[1] for m in (torch, wrapt, yaml)}:
        for entry in source.iterdir():
            name = entry.name.lower()
            if name.startswith(("amp_patch", "__editable__", "apex")) or name.endswith(".pth") or name == "__pycache__":
                continue
            if not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    Path(site, "outer_dependencies.pth").write_text(f"{deps}\n")
    return python


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_environment_imports_every_module_and_trains(tmp_path, wheel):
    """As users install it: a wheel, in a virtual environment of its own, with
    no checkout and no editable install within reach. An editable install's
    finder serves any module the wheel left out, so only here does a package
    missing from the build show."""
    python = _fresh_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "AMP_PATCH_", "VIRTUAL_ENV"))}
    res = subprocess.run([str(python), "-c", INSTALLED_PROBE, str(ROOT)], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("REPORT "))[len("REPORT "):])

    venv = (tmp_path / "venv").resolve()
    assert venv in Path(report["file"]).resolve().parents, report["file"]
    # no editable finder, no checkout on sys.path, no module loaded from the checkout
    assert report["finders"] == [] and report["path"] == [] and report["from_checkout"] == []
    assert report["elsewhere"] == []  # every amp_patch module came from the install
    assert report["failed"] == {}, "\n".join(report["failed"].values())
    installed = set(report["modules"])
    assert _checkout_modules() - installed == set(), "the wheel lacks these modules"
    # the wheel holds nothing more than the checkout's modules and the optional C parts
    assert installed - _checkout_modules() <= {"amp_patch.patching._fastpath", "amp_patch.precision._onepass"}

    o1, o2 = report["steps"]["O1"], report["steps"]["O2"]
    assert o1["finite"] and o2["finite"] and o1["moved"] and o2["moved"]
    # O1: FP32 weights, the patched Linear computes in BF16 (CPU's default half type)
    assert o1["params"] == ["torch.float32"] and o1["out"] == "torch.bfloat16"
    # O2: BF16 weights with FP32 master copies, FP32 outputs
    assert o2["params"] == ["torch.bfloat16"] and o2["masters"] == ["torch.float32"] and o2["out"] == "torch.float32"
    assert report["apex_amp"] == "amp_patch.amp"

    script = python.parent / ("amp-patch.exe" if os.name == "nt" else "amp-patch")
    res = subprocess.run([str(script), "--version"], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "0.1.0" in res.stdout + res.stderr, res.stdout + res.stderr
