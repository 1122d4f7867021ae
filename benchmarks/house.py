"""How the package is built, in four figures: what a restructure is measured by.

    python benchmarks/house.py                 # this checkout's amp_patch/
    python benchmarks/house.py --rev HEAD~5    # a commit of this repository (git show)

Prints:

- **functions taking the Session**: functions or methods with a parameter
  annotated ``Session`` (or named ``amp``/``session`` without another
  annotation), outside ``run/`` and the public face, which own it;
- **Session fields**: attributes ``Session.__init__`` sets;
- **arrows up**: imports from a module to one on a higher floor
  (``tests/test_packaging.py``'s ``FLOORS``), type-only imports included;
- **longest function**: its name and its length in lines.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]

FLOORS = [
    {"base"},
    {"config"},
    {"oplists"},
    {"patching"},
    {"diagnostics"},
    {"precision"},
    {"scaling"},
    {"run"},
    {"face"},
    {"apex", "frontends"},
]
OWNERS = {"run", "face", "apex", "frontends"}  # where the Session is composed and handed out


def _sources(rev: str) -> Dict[str, str]:
    """``{module path: source}`` of ``amp_patch/`` at ``rev`` ('' for the working tree)."""
    if not rev:
        return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in (ROOT / "amp_patch").rglob("*.py")}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "amp_patch"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout for n in names if n.endswith(".py")}


def _group(path: str) -> str:
    parts = Path(path).parts
    if len(parts) > 2:
        return parts[1]
    return "apex" if parts[-1] == "amp.py" else "face"


def _module(path: str) -> str:
    mod = path[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node  # type: ignore[misc]


def _takes_session(fn: ast.FunctionDef) -> bool:
    for a in fn.args.args + fn.args.kwonlyargs:
        ann = ast.unparse(a.annotation) if a.annotation is not None else ""
        if "Session" in ann or (not ann and a.arg in ("amp", "session")):
            return True
    return False


def _imports(path: str, tree: ast.AST, modules: set) -> Iterator[str]:
    mod = _module(path)
    package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                yield target if target in modules else base
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name


def measure(rev: str = "") -> Dict[str, object]:
    sources = _sources(rev)
    trees = {p: ast.parse(s) for p, s in sources.items()}
    modules = {_module(p) for p in sources}
    where = {_module(p): p for p in sources}
    floor = {g: i for i, gs in enumerate(FLOORS) for g in gs}
    taking: List[str] = []
    longest: Tuple[int, str] = (0, "")
    for path, tree in trees.items():
        for fn in _functions(tree):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            longest = max(longest, (n, f"{_module(path)}.{fn.name}"))
            if _group(path) not in OWNERS and _takes_session(fn):
                taking.append(f"{_module(path)}.{fn.name}")
    fields = set()
    session = trees.get("amp_patch/run/session.py")
    if session is not None:
        for node in ast.walk(session):
            if isinstance(node, ast.ClassDef) and node.name == "Session":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        for st in ast.walk(item):
                            targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []
                            for t in targets:
                                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                    fields.add(t.attr)
    up = []
    for path, tree in trees.items():
        if _module(path) in ("amp_patch", "amp_patch.__main__", "amp_patch.auto"):
            continue
        for target in set(_imports(path, tree, modules)):
            if target in where and floor.get(_group(where[target]), 0) > floor.get(_group(path), 0):
                up.append(f"{_module(path)} -> {target}")
    return {"functions taking the Session": len(taking), "Session fields": len(fields),
            "arrows up": len(up), "longest function": f"{longest[1]} ({longest[0]} lines)",
            "_taking": sorted(taking), "_up": sorted(up)}


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="", help="a git revision to measure instead of the working tree")
    p.add_argument("--list", action="store_true", help="also list the functions and the upward imports")
    ns = p.parse_args(argv)
    m = measure(ns.rev)
    for k, v in m.items():
        if not k.startswith("_"):
            print(f"{k}: {v}")
    if ns.list:
        print("\n".join(["", "taking the Session:"] + list(m["_taking"]) + ["", "arrows up:"] + list(m["_up"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
