"""``amp-patch check-script SCRIPT``: the Apex names a script uses, and whether
amp_patch serves each, read from the script's source without running it.

The script is parsed, never imported. Every ``import apex...``, ``from apex...
import ...`` and ``import amp_C`` binds local names; every use of those names
(``amp.initialize``, ``amp._amp_state.loss_scalers``, ``DDP(...)``,
``apex.parallel.convert_syncbn_model``) is looked up in the stand-in modules
the apex alias would serve (``alias.STANDINS``).
"""
from __future__ import annotations

import ast
import dataclasses
import types
from typing import Dict, List, Optional, Tuple

from . import alias


@dataclasses.dataclass(frozen=True)
class Use:
    """One Apex name a script uses, where first, and who serves it."""

    name: str  # dotted, as Apex spells it: "apex.parallel.DistributedDataParallel"
    line: int
    served_by: Optional[str]  # the amp_patch object that stands in, or None
    hint: str = ""  # what to use instead, when not served


def _is_apex(dotted: str) -> bool:
    return dotted == "apex" or dotted.startswith("apex.") or dotted == "amp_C" or dotted.startswith("amp_C.")


class _Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.bound: Dict[str, str] = {}  # local name -> dotted Apex name
        self.uses: Dict[str, int] = {}  # dotted Apex name -> first line

    def _use(self, name: str, line: int) -> None:
        self.uses.setdefault(name, line)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _is_apex(a.name):
                self._use(a.name, node.lineno)
                if a.asname:
                    self.bound[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    self.bound[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level or not _is_apex(mod):
            return
        for a in node.names:
            dotted = f"{mod}.{a.name}"
            self._use(dotted, node.lineno)
            if a.name != "*":
                self.bound[a.asname or a.name] = dotted

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: List[str] = []
        cur: ast.AST = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in self.bound:
            dotted = ".".join([self.bound[cur.id]] + chain[::-1])
            self._use(dotted, node.lineno)
            return  # the whole chain is one use; its inner attributes are prefixes of it
        self.generic_visit(node)


def _splits(dotted: str) -> List[Tuple[str, types.ModuleType, List[str]]]:
    """Every ``(served module name, its stand-in, attribute names after it)``
    reading of ``dotted``, longest module first: ``apex.amp._amp_state.x`` is
    both the module ``apex.amp._amp_state`` and the attribute ``_amp_state`` of ``apex.amp``."""
    parts = dotted.split(".")
    out = []
    for n in range(len(parts), 0, -1):
        mod = ".".join(parts[:n])
        module = alias.standin_module(mod)
        if module is not None:
            out.append((mod, module, parts[n:]))
    return out


def _lookup(obj: object, attr: str) -> object:
    if not isinstance(obj, types.ModuleType) and isinstance(getattr(type(obj), attr, None), property):
        # a property that needs a running session (``_amp_state.loss_scalers``): found, not run
        return getattr(type(obj), attr)
    return getattr(obj, attr)


def resolve(dotted: str) -> Tuple[Optional[str], str]:
    """``(what serves dotted, "")`` or ``(None, what to use instead)``."""
    if dotted == "apex":
        return "amp_patch's stand-in apex package", ""
    readings = _splits(dotted)
    if not readings:
        return None, alias.replacement(dotted)
    failure = ""
    for mod, obj, rest in readings:
        where = obj.__name__
        for i, attr in enumerate(rest):
            if attr == "*":
                return f"{where}.*", ""
            try:
                obj = _lookup(obj, attr)
            except AttributeError:
                if i == 0:
                    failure = failure or f"{mod} has no {attr!r} in amp_patch's stand-in ({where})"
                    break
                return where, ""  # deeper than can be told without running: the served part counts
            where = f"{where}.{attr}"
        else:
            return where, ""
    return None, failure


def scan(source: str, filename: str = "<script>") -> List[Use]:
    """Every Apex name ``source`` imports or uses, in order of first use.

    Raises:
        SyntaxError: the script does not parse.

    Example::

        for use in scan(open("train.py").read(), "train.py"):
            print(use.line, use.name, use.served_by or use.hint)
    """
    tree = ast.parse(source, filename)
    c = _Collector()
    c.visit(tree)
    names = sorted(c.uses.items(), key=lambda kv: (kv[1], kv[0]))
    # a module's use is covered by the uses of its names ("apex.parallel" by "apex.parallel.DDP")
    names = [(n, l) for n, l in names if not any(o.startswith(n + ".") for o, _ in names) or n.endswith("*")]
    out = []
    for name, line in names:
        served_by, hint = resolve(name)
        out.append(Use(name, line, served_by, hint))
    return out


def report(uses: List[Use], filename: str) -> Tuple[str, int]:
    """The table ``check-script`` prints, and its exit code (0: all served, 1: some not)."""
    if not uses:
        return f"{filename}: uses no Apex names; it runs under amp-patch run as it is\n", 0
    missing = [u for u in uses if u.served_by is None]
    lines = []
    if alias._real_apex_amp_importable():
        lines.append("note: a real apex.amp is installed here, so the real Apex runs these names, not amp_patch")
    width = max(len(u.name) for u in uses)
    for u in uses:
        what = f"served by {u.served_by}" if u.served_by else f"NOT served: {u.hint}"
        lines.append(f"  line {u.line:<5} {u.name:<{width}}  {what}")
    head = (f"{filename}: {len(uses)} Apex name(s), all served by amp_patch" if not missing
            else f"{filename}: {len(uses)} Apex name(s), {len(missing)} not served by amp_patch")
    return "\n".join([head] + lines) + "\n", 1 if missing else 0


#: the modules whose ``initialize`` a script may call itself, replacing the launcher's settings
_INITIALIZERS = ("amp_patch", "amp_patch.amp", "apex.amp")


def _dotted(node: ast.AST, bound: Dict[str, str]) -> Optional[str]:
    """``a.b.c`` of an attribute chain, its head name resolved through ``bound``."""
    chain: List[str] = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in bound:
        return None
    return ".".join([bound[node.id]] + chain[::-1])


def initialize_call(source: str, filename: str = "<script>") -> Optional[Tuple[int, str]]:
    """``(line, spelling)`` of the first call of ``amp.initialize`` /
    ``amp_patch.initialize`` in ``source``, or None: the script sets its own
    opt level where it runs that line (read, never run; None when it does not parse).

    Example::

        initialize_call("from apex import amp\\nmodel, opt = amp.initialize(model, opt)\\n")  # (2, "amp.initialize")
    """
    try:
        tree = ast.parse(source, filename)
    except SyntaxError:
        return None
    bound: Dict[str, str] = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    wanted = {f"{m}.initialize" for m in _INITIALIZERS}
    calls = [
        (node.lineno, ast.unparse(node.func)) for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _dotted(node.func, bound) in wanted
    ]
    return min(calls) if calls else None
