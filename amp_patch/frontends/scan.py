"""``amp-patch check-script SCRIPT``: the Apex names a script uses, and whether
amp_patch serves each, read from the script's source without running it.

The script is parsed, never imported. Every ``import apex...``, ``from apex...
import ...``, ``import amp_C`` (and Apex's other extensions, ``apex_C``,
``fused_adam_cuda``, ...) and ``importlib.import_module("...")`` of one binds
local names; so does an assignment of an Apex expression
(``scaler = amp._amp_state.loss_scalers[0]``, ``opt = FusedAdam(...)``).
Every use of those names is one chain of attributes, subscripts and calls
(``amp._amp_state.loss_scalers[0]._overflow_buf``), and every step of it is
looked up in the stand-in the apex alias would serve (``apex.standins.STANDINS``):

* an attribute must exist on the object, or on the class of an instance
  (class attributes, methods, properties, and what its methods assign to
  ``self``);
* a property is followed through its return annotation, without running it
  (``loss_scalers`` is a ``List[ScalerView]``, so ``[0]`` is a ``ScalerView``);
* a call must bind: each keyword, and the number of positional arguments,
  checked against the signature of what runs (``FusedAdam(max_grad_norm=1.0)``);
  a class called gives an instance, a function its return annotation.

A chain ends where its value leaves amp_patch (a tensor, the user's model);
where a step cannot be told without running (a function without a return
annotation) the steps after it are not checked, and the name is reported as
far as it was. Names are written as Apex spells them, with ``[]`` for a
subscript and ``(kw=)`` for a keyword: ``apex.amp._amp_state.loss_scalers[]._overflow_buf``,
``apex.optimizers.FusedAdam(max_grad_norm=)``.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from . import alias


@dataclasses.dataclass(frozen=True)
class Use:
    """One Apex name a script uses, where first, and who serves it."""

    name: str  # as Apex spells it: "apex.parallel.DistributedDataParallel", "...FusedAdam(max_grad_norm=)"
    line: int
    served_by: Optional[str]  # the amp_patch object that stands in, or None
    hint: str = ""  # what to use instead, when not served


# One step of a chain: ("attr", name), ("item",), ("call", n_positional, keywords, starred), or
# ("kw", name): a keyword of the call the chain ends in, which gets a verdict of its own; ("store",)
# last: the chain's final attribute is assigned to (rendered with a trailing " =")
Step = Tuple[Any, ...]


def _is_apex(dotted: str) -> bool:
    top = dotted.split(".")[0]
    return top == "apex" or top in alias.EXTENSIONS


def render(root: str, steps: List[Step]) -> str:
    """A chain as check-script prints it: ``apex.amp._amp_state.loss_scalers[]._overflow_buf``."""
    out = root
    for step in steps:
        if step[0] == "attr":
            out += "." + step[1]
        elif step[0] == "item":
            out += "[]"
        elif step[0] == "kw":
            out += f"({step[1]}=)"
        else:
            out += "()"
    return out


def _import_module_name(node: ast.AST) -> Optional[str]:
    """The constant module name of ``importlib.import_module("...")`` / ``import_module("...")``."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    name = node.args[0].value
    return name if called == "import_module" and isinstance(name, str) else None


class _Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.bound: Dict[str, Tuple[str, List[Step]]] = {}  # local name -> (dotted root, steps after it)
        self.uses: Dict[str, Tuple[int, str, List[Step]]] = {}  # rendered name -> (first line, root, steps)

    def _use(self, root: str, steps: List[Step], line: int, store: bool = False) -> None:
        name = render(root, steps) + (" =" if store else "")
        if name not in self.uses:
            self.uses[name] = (line, root, list(steps) + ([("store",)] if store else []))

    # ------------------------------------------------------------ binding

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _is_apex(a.name):
                self._use(a.name, [], node.lineno)
                top = a.name.split(".")[0]
                self.bound[a.asname or top] = (a.name if a.asname else top, [])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level or not _is_apex(mod):
            return
        for a in node.names:
            self._use(mod, [("attr", a.name)], node.lineno)
            if a.name != "*":
                self.bound[a.asname or a.name] = (mod, [("attr", a.name)])

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        chain = self._chain(node.value)
        # a name bound to an Apex expression stands for it; a module or class
        # name set to something else (`amp = None` after a failed import) keeps
        # its Apex binding, an instance's name (`opt = FusedAdam(...)`) loses it
        for t in node.targets:
            if isinstance(t, ast.Name) and chain is not None:
                self.bound[t.id] = chain
            elif isinstance(t, ast.Name) and any(st[0] == "call" for st in self.bound.get(t.id, ("", []))[1]):
                del self.bound[t.id]  # an instance of an Apex class, replaced by something else
        for t in node.targets:
            if isinstance(t, ast.Attribute) and self._chain(t) is not None:
                root, steps = self._chain(t)  # an attribute set: it must be settable
                self._use(root, steps, t.lineno, store=True)
                self._visit_inside(t.value)
                inner = self._chain(t.value)
                if inner is not None and inner[1]:
                    self._use(inner[0], inner[1], t.lineno)
            elif not isinstance(t, ast.Name):
                self.visit(t)

    # ------------------------------------------------------------ chains

    def _chain(self, node: ast.AST) -> Optional[Tuple[str, List[Step]]]:
        """``(root, steps)`` when ``node`` is an Apex chain, else None."""
        module = _import_module_name(node)
        if module is not None and _is_apex(module):
            return module, []
        if isinstance(node, ast.Name):
            found = self.bound.get(node.id)
            return None if found is None else (found[0], list(found[1]))
        if isinstance(node, ast.Attribute):
            inner = self._chain(node.value)
            return None if inner is None else (inner[0], inner[1] + [("attr", node.attr)])
        if isinstance(node, ast.Subscript):
            inner = self._chain(node.value)
            return None if inner is None else (inner[0], inner[1] + [("item",)])
        if isinstance(node, ast.Call):
            inner = self._chain(node.func)
            if inner is None:
                return None
            starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
            return inner[0], inner[1] + [("call", len(node.args), keywords, starred)]
        return None

    def _visit_chain(self, node: ast.AST) -> bool:
        """Record the chain ``node`` is (its arguments visited too); False when it is none."""
        chain = self._chain(node)
        if chain is None:
            return False
        root, steps = chain
        self._use(root, steps, node.lineno)
        for i, step in enumerate(steps):
            if step[0] == "call":
                for kw in step[2]:  # each keyword its own name, so each gets its own verdict
                    self._use(root, steps[:i] + [("kw", kw)], node.lineno)
        self._visit_inside(node)
        return True

    def _visit_inside(self, node: ast.AST) -> None:
        """Visit what a chain's subscripts and calls hold (arguments may use Apex names too)."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            if isinstance(node, ast.Call):
                for a in node.args:
                    self.visit(a)
                for k in node.keywords:
                    self.visit(k.value)
                node = node.func
            elif isinstance(node, ast.Subscript):
                self.visit(node.slice)
                node = node.value
            else:
                node = node.value

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._visit_chain(node):
            self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if not self._visit_chain(node):
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if not self._visit_chain(node):
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and node.id in self.bound:
            root, steps = self.bound[node.id]
            self._use(root, steps, node.lineno)


# ---------------------------------------------------------------- resolving


class _Instance:
    """An instance of ``cls`` whose value is not known without running."""

    def __init__(self, cls: type):
        self.cls = cls


class _Elements:
    """The elements of a container annotated ``List[X]`` / ``Sequence[X]``: ``X``."""

    def __init__(self, element: object):
        self.element = element


class _Unknown(Exception):
    """The next step cannot be told without running: the chain is checked as far as it got."""


def _ours(obj: object) -> bool:
    """Whether ``obj`` (or the class of an instance) is amp_patch's: chains are checked only through those."""
    target = obj.cls if isinstance(obj, _Instance) else obj
    module = getattr(target, "__module__", None) or getattr(target, "__name__", "")
    return isinstance(module, str) and module.startswith("amp_patch")


def _from_annotation(annotation: object) -> "_Elements | _Instance":
    """What a value of this type annotation is, for the next step."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, typing.List, typing.Sequence) or (
            origin is not None and getattr(origin, "__name__", "") in ("Sequence", "Iterable", "Iterator")):
        args = typing.get_args(annotation)
        return _Elements(args[0] if args else None)
    if isinstance(annotation, type):
        return _Instance(annotation)
    raise _Unknown()


def _return_of(fn: object) -> "_Elements | _Instance":
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not evaluate: not knowable here
        raise _Unknown()
    if "return" not in hints:
        raise _Unknown()
    return _from_annotation(hints["return"])


@functools.lru_cache(maxsize=None)
def _self_attributes(cls: type) -> Set[str]:
    """The attributes the methods of ``cls`` (and its bases) assign to ``self``."""
    names: Set[str] = set()
    for klass in cls.__mro__[:-1]:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _attribute(obj: object, name: str) -> object:
    """The next value of a chain after ``.name``; raises AttributeError when there is none."""
    if isinstance(obj, _Elements):
        raise _Unknown()
    if isinstance(obj, _Instance):
        cls = obj.cls
        attr = inspect.getattr_static(cls, name, _MISSING)
        if attr is _MISSING:
            if name in _self_attributes(cls):
                raise _Unknown()
            if any("__getattr__" in vars(k) for k in cls.__mro__[:-1]):
                raise _Unknown()  # a class that answers attributes itself (nn.Module's parameters and submodules)
            raise AttributeError(name)
        if isinstance(attr, property):
            return _return_of(attr.fget)
        if isinstance(attr, (staticmethod, classmethod)):
            return getattr(cls, name)
        if callable(attr):
            return _Bound(attr)
        return attr
    if not isinstance(obj, types.ModuleType) and isinstance(getattr(type(obj), name, None), property):
        # a property that needs a running session (``_amp_state.loss_scalers``): found, not run
        return _return_of(getattr(type(obj), name).fget)
    return getattr(obj, name)


def _settable(obj: object, name: str) -> None:
    """Raise AttributeError("read-only ...") when ``obj.name = value`` would fail:
    a property without a setter, or a class with ``__slots__`` that lacks it."""
    cls = obj.cls if isinstance(obj, _Instance) else obj if isinstance(obj, type) else type(obj)
    if isinstance(obj, (types.ModuleType, _Elements)):
        return
    attr = inspect.getattr_static(cls, name, _MISSING)
    if isinstance(attr, property) and attr.fset is None:
        raise AttributeError(f"read-only property {cls.__name__}.{name}")
    if attr is _MISSING and "__dict__" not in dir(cls) and hasattr(cls, "__slots__"):
        raise AttributeError(f"read-only: {cls.__name__} has __slots__ without {name!r}")


class _Bound:
    """A method of an instance not known without running: its function, called without ``self``."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn


_MISSING = object()


def _call(obj: object, step: Step) -> object:
    """The value of calling ``obj`` as ``step`` says; raises TypeError when the call cannot bind."""
    _, n_args, keywords, starred = step
    if isinstance(obj, (_Instance, _Elements)):
        fn = obj.cls.__call__ if isinstance(obj, _Instance) and callable(obj.cls) else None
        if fn is None or not _ours(obj):
            raise _Unknown()
        obj = _Bound(fn)
    target = obj.fn if isinstance(obj, _Bound) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        raise _Unknown()
    if isinstance(obj, _Bound):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    if not starred:  # the keywords are checked one by one, as their own names
        sig.bind_partial(*([None] * n_args))
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    named = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for k in keywords:
        if k not in named and not accepts_any:
            raise TypeError(f"got an unexpected keyword argument {k!r}")
    if isinstance(target, type):
        return _Instance(target)
    return _return_of(target)


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


def _walk(obj: object, where: str, steps: List[Step]) -> Tuple[Optional[str], int, str]:
    """Follow ``steps`` from ``obj``: ``(what serves it, len(steps), "")``, or
    ``(None, index of the step that fails, why)``."""
    for i, step in enumerate(steps):
        if not _ours(obj) and not isinstance(obj, (_Elements, _Bound)):
            return where, len(steps), ""  # the value left amp_patch: the Apex name ended before
        kind = step[0]
        try:
            if kind == "attr" and i + 1 < len(steps) and steps[i + 1][0] == "store":
                _settable(obj, step[1])
                return f"{where}.{step[1]}", len(steps), ""
            if kind == "kw":
                _call(obj, ("call", 0, (step[1],), True))
                return f"{where}({step[1]}=)", len(steps), ""
            if kind == "attr":
                if step[1] == "*":
                    return f"{where}.*", len(steps), ""
                obj = _attribute(obj, step[1])
                where = f"{where}.{step[1]}"
            elif kind == "item":
                if isinstance(obj, _Elements):
                    obj = _from_annotation(obj.element) if obj.element is not None else None
                    if obj is None:
                        return f"{where}[]", len(steps), ""
                elif isinstance(obj, (list, tuple)) and obj:
                    obj = obj[0]
                else:
                    return f"{where}[]", len(steps), ""
                where = f"{where}[]"
            else:  # its keywords get verdicts of their own ("kw" steps)
                obj = _call(obj, (step[0], step[1], (), step[3]))
                where = f"{where}()"
        except _Unknown:
            return where, len(steps), ""
        except AttributeError as e:
            if str(e).startswith("read-only"):
                return None, i, f"cannot set {step[1]!r} in amp_patch's stand-in ({where}): {e}"
            return None, i, f"has no {step[1]!r} in amp_patch's stand-in ({where})"
        except TypeError as e:
            return None, i, f"does not take this call in amp_patch's stand-in ({where}): {e}"
    return where, len(steps), ""


def resolve_steps(root: str, steps: List[Step]) -> Tuple[Optional[str], str]:
    """``(what serves the chain, "")`` or ``(None, why not and what to use instead)``."""
    if root == "apex" and not steps:
        return "amp_patch's stand-in apex package", ""
    # the leading attributes may name submodules: `apex` + `.parallel.LARC`
    lead = 0
    while lead < len(steps) and steps[lead][0] == "attr":
        lead += 1
    dotted = ".".join([root] + [s[1] for s in steps[:lead]])
    readings = _splits(dotted)
    if not readings:
        return None, alias.replacement(dotted)
    failures = []  # (how far the reading got, why it stops)
    for mod, module, rest in readings:
        walked = [("attr", a) for a in rest] + list(steps[lead:])
        where, at, why = _walk(module, module.__name__, walked)
        if where is not None:
            return where, ""
        failure = f"{render(mod, walked[:at])} {why}"
        if at == 0 and walked[0][0] == "attr":  # perhaps a module amp_patch does not serve
            failure += f"; {alias.replacement(mod + '.' + walked[0][1])}"
        failures.append((len(steps) - len(walked) + at, failure))
    return None, max(failures, key=lambda f: f[0])[1]


def resolve(dotted: str) -> Tuple[Optional[str], str]:
    """``(what serves dotted, "")`` or ``(None, what to use instead)``, for a plain dotted name."""
    root, *rest = dotted.split(".")
    return resolve_steps(root, [("attr", r) for r in rest])


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
    names = sorted(c.uses.items(), key=lambda kv: (kv[1][0], kv[0]))
    # a name's use is covered by the longer uses through it ("apex.parallel" by "apex.parallel.DDP")
    keep = [(n, v) for n, v in names
            if n.endswith("*") or n.endswith(" =") or
            not any(o != n and o.startswith(n) and o[len(n)] in ".[(" for o, _ in names)]
    out = []
    for name, (line, root, steps) in keep:
        served_by, hint = resolve_steps(root, steps)
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
