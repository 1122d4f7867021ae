"""Loading the op lists: read the YAML files, validate them, apply overrides, resolve.

A list file (default or override) maps namespaces to policies to ops::

    torch.nn.functional:
      half: [linear, conv2d]
      float:
        - name: softmax
          when: {dtype: float16}   # only under FP16
          why: FP16 exp overflows; BF16 kernels accumulate in FP32
      remove: [gelu]             # overrides only: take an op out of every list

An entry is a name or a mapping with ``name`` and optional ``when``
(``dtype``: float16|bfloat16, ``device``: cpu|cuda), ``optional`` (the op may
be absent from this torch version), ``why`` and, for ``banned``, ``fix``.

An in-place form that no list names (``exp_`` for ``exp``, ``__ipow__`` for
``__pow__``) follows its out-of-place op, as in apex.amp: under ``float`` it
refuses a half receiver, under ``half`` and ``promote`` it casts its other
inputs to the receiver's dtype. Listing the in-place name, or removing it in
an override, takes it out of that rule.

Everything is validated before anything is patched. Every problem names the
file, line, key and entry, and the nearest valid name.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import types
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import yaml

from ..base.errors import ListError
from .schema import INPLACE_DUNDERS, POLICIES, PROTOCOL_WRITES

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

log = logging.getLogger("amp_patch")

#: namespaces a list may name, and the objects whose attributes get patched.
#: ``torch._VF`` holds the RNN kernels ``nn.LSTM``/``nn.GRU``/cells call.
NAMESPACES: Dict[str, Any] = {
    "torch": torch,
    "torch.nn.functional": torch.nn.functional,
    "torch.Tensor": torch.Tensor,
    "torch.linalg": torch.linalg,
    "torch.special": torch.special,
    "torch.fft": torch.fft,
    "torch._VF": torch._VF,
}
ENTRY_KEYS = ("name", "when", "optional", "why", "fix")
WHEN_KEYS = {"dtype": ("float16", "bfloat16"), "device": ("cpu", "cuda")}
MAX_BYTES = 1 << 20  # an op list is a few KiB; refuse anything absurd
ENV_VAR = "AMP_PATCH_LISTS"

_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "bool", "null", "float", "seq", "map"))

ListSource = Union[str, os.PathLike, Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One op under one policy, where it came from, and when it applies."""

    namespace: str
    name: str
    policy: str
    when: Tuple[Tuple[str, str], ...] = ()
    optional: bool = False
    why: str = ""
    fix: str = ""
    source: str = ""
    derived_from: str = ""  # the out-of-place op an implied in-place entry follows

    @property
    def key(self) -> Tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def qualname(self) -> str:
        return f"{self.namespace}.{self.name}"

    def applies(self, dtype: str, device: str) -> bool:
        ctx = {"dtype": dtype, "device": device}
        return all(ctx[k] == v for k, v in self.when)

    def overlaps(self, other: "Entry") -> bool:
        mine, theirs = dict(self.when), dict(other.when)
        return all(theirs.get(k, v) == v for k, v in mine.items())


def _nearest(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def _op_names(namespace: str) -> List[str]:
    return [n for n in dir(NAMESPACES[namespace]) if not n.startswith("_") or n.startswith("__")]


def op_exists(namespace: str, name: str) -> bool:
    return callable(getattr(NAMESPACES[namespace], name, None))


#: callables that live beside the ops but are not tensor ops: wrapping one
#: would cast what it saves or loads, or break the object protocol (context
#: managers such as no_grad and autocast are classes, refused as such)
_NOT_OPS = frozenset((
    "save", "load", "from_file", "manual_seed", "seed", "initial_seed", "compile", "typename",
    "use_deterministic_algorithms", "set_printoptions", "set_num_threads", "set_num_interop_threads",
    "__getattribute__", "__getattr__", "__setattr__", "__delattr__", "__dir__", "__init__", "__new__",
    "__del__", "__init_subclass__", "__subclasshook__", "__class__", "__repr__", "__str__", "__format__",
    "__hash__", "__bool__", "__len__", "__iter__", "__next__", "__contains__", "__reduce__", "__reduce_ex__",
    "__getstate__", "__setstate__", "__copy__", "__deepcopy__", "__sizeof__", "__enter__", "__exit__",
    "__torch_function__", "__torch_dispatch__", "__array__", "__array_wrap__", "__array_priority__",
    "__dlpack__", "__dlpack_device__", "__index__", "__int__", "__float__", "__complex__", "__instancecheck__",
))


def not_an_op(owner: object, name: str) -> Optional[str]:
    """Why ``owner.name`` cannot be wrapped as an op although it exists, or None."""
    obj = getattr(owner, name, None)
    if isinstance(obj, type):
        return "is a class"
    if isinstance(obj, types.ModuleType):
        return "is a module"
    if name in _NOT_OPS or name.startswith(("set_default", "get_default")):
        return "is serialization, random state, configuration or the object protocol"
    return None


class _Reader:
    """Turns one YAML document into Entries, collecting every problem."""

    def __init__(self, where: str, allow_remove: bool):
        self.where = where
        self.allow_remove = allow_remove
        self.problems: List[str] = []
        self.entries: List[Entry] = []
        self.removed: List[Entry] = []

    def problem(self, line: Optional[int], path: str, msg: str) -> None:
        loc = f"{self.where}:{line}" if line else self.where
        self.problems.append(f"{loc}: " + " ".join(part for part in (path, msg) if part))

    # -- from a composed YAML node tree (keeps line numbers)
    def read_node(self, root: yaml.Node) -> None:
        seen_nodes: set = set()

        def plain(node: yaml.Node) -> Any:
            # Anchors/aliases make a node appear twice; lists need neither and
            # refusing them defuses "billion laughs" documents.
            if id(node) in seen_nodes:
                raise ListError(f"{self.where}:{node.start_mark.line + 1}: YAML anchors and aliases are not allowed in op lists")
            seen_nodes.add(id(node))
            if node.tag not in _PLAIN_TAGS:
                raise ListError(f"{self.where}:{node.start_mark.line + 1}: YAML tag {node.tag!r} is not allowed in op lists; use plain names, lists and mappings")
            if isinstance(node, yaml.MappingNode):
                return _Mapping([(plain(k), plain(v), k.start_mark.line + 1) for k, v in node.value])
            if isinstance(node, yaml.SequenceNode):
                return _Seq([(plain(v), v.start_mark.line + 1) for v in node.value])
            return loader.construct_object(node, deep=True)

        # Scalars resolve as safe_load resolves them (true -> True, 1 -> 1).
        loader = yaml.SafeLoader("")
        try:
            self.read(plain(root), 1)
        finally:
            loader.dispose()

    def read(self, doc: object, line: Optional[int]) -> None:
        items = _items(doc)
        if items is None:
            self.problem(line, "", "must be a mapping of namespaces (e.g. 'torch.nn.functional:') to policies")
            return
        seen_ns = set()
        for ns, body, nline in items:
            if ns in seen_ns:
                self.problem(nline, str(ns), "appears twice in this file; merge the two blocks")
                continue
            seen_ns.add(ns)
            if ns not in NAMESPACES:
                self.problem(nline, "", f"{ns!r} is not a known namespace{_nearest(ns, NAMESPACES)} (known: {', '.join(NAMESPACES)})")
                continue
            pitems = _items(body)
            if pitems is None:
                self.problem(nline, ns, "must map policy names to lists of ops")
                continue
            valid = POLICIES + (("remove",) if self.allow_remove else ())
            seen_pol = set()
            for pol, ops, pline in pitems:
                if pol in seen_pol:
                    self.problem(pline, f"{ns}.{pol}", "appears twice; merge the two lists")
                    continue
                seen_pol.add(pol)
                if pol not in valid:
                    extra = " ('remove' is only for overrides)" if pol == "remove" else ""
                    self.problem(pline, f"{ns}.{pol}", f"is not a policy{_nearest(pol, valid)} (valid: {', '.join(valid)}){extra}")
                    continue
                seq = _seq(ops)
                if seq is None:
                    given = _items(ops)
                    if given:  # `float: {mm: yes}`: the names are the keys
                        names = ", ".join(str(k) for k, _, _ in given)
                        self.problem(pline, f"{ns}.{pol}", f"is a mapping; it must be a list of op names: write "
                                     f"`{pol}: [{names}]` (an entry with options is a mapping with 'name' inside the list)")
                    else:
                        self.problem(pline, f"{ns}.{pol}", "must be a list of op names")
                    continue
                for i, (item, eline) in enumerate(seq):
                    self.read_entry(ns, pol, i, item, eline or pline)

    def read_entry(self, ns: str, pol: str, i: int, item: object, line: Optional[int]) -> None:
        path = f"{ns}.{pol}[{i}]"
        fields: Dict[str, Any] = {}
        before = len(self.problems)  # every problem of the entry is reported, then it is dropped
        if isinstance(item, str):
            fields["name"] = item
        else:
            its = _items(item)
            if its is None:
                self.problem(line, path, f"{item!r} must be an op name or a mapping with 'name'")
                return
            for k, v, _ in its:
                if k not in ENTRY_KEYS:
                    self.problem(line, path, f"has unknown key {k!r}{_nearest(k, ENTRY_KEYS)} (valid: {', '.join(ENTRY_KEYS)})")
                    continue
                fields[k] = v
            if not isinstance(fields.get("name"), str):
                self.problem(line, path, "needs a 'name' that is a string")
                return
        name = fields["name"]
        when = []
        w = fields.get("when") or {}
        witems = _items(w)
        if witems is None:
            self.problem(line, path, f"'when' of {name!r} must be a mapping like {{dtype: float16}}")
            witems = []
        for k, v, _ in witems:
            if k not in WHEN_KEYS:
                self.problem(line, path, f"'when' of {name!r} has unknown key {k!r}{_nearest(k, WHEN_KEYS)} (valid: dtype, device)")
            elif v not in WHEN_KEYS[k]:
                self.problem(line, path, f"'when.{k}' of {name!r} is {v!r}{_nearest(v, WHEN_KEYS[k])} (valid: {', '.join(WHEN_KEYS[k])})")
            else:
                when.append((k, v))
        optional = fields.get("optional", False)
        if not isinstance(optional, bool):
            self.problem(line, path, f"'optional' of {name!r} must be true or false")
            optional = False
        if not op_exists(ns, name):
            if optional:
                log.debug("amp_patch: optional op %s.%s is not in torch %s; not patched", ns, name, torch.__version__)
            else:
                homes = [n for n in NAMESPACES if n != ns and not n.startswith("torch._") and op_exists(n, name)]
                if homes:
                    also = f" (also in {', '.join(homes[1:])})" if len(homes) > 1 else ""
                    self.problem(line, path, f"{name!r} is not in {ns}; it is in {homes[0]}{also}: list it under {homes[0]}:")
                else:
                    self.problem(line, path, f"{name!r} is not in {ns}{_nearest(name, _op_names(ns))} (mark it 'optional: true' if it exists only in some torch versions)")
        elif pol != "remove" and name in PROTOCOL_WRITES:
            self.problem(
                line, path,
                f"{ns}.{name} writes into its receiver (h[i] = v), whose dtype an op list cannot change: a casting "
                f"wrapper would write into a temporary copy and the tensor would never change. Remove the entry; "
                f"the value assigned already takes the receiver's dtype.",
            )
        elif pol != "remove":
            why = not_an_op(NAMESPACES[ns], name)
            if why is not None:
                self.problem(
                    line, path,
                    f"{ns}.{name} {why}, not a tensor op; only functions that compute on tensors can be listed "
                    f"(amp_patch would replace it with a casting wrapper). Remove the entry.",
                )
        if len(self.problems) > before:
            return
        e = Entry(ns, name, pol, tuple(sorted(when)), optional, str(fields.get("why", "")), str(fields.get("fix", "")), f"{self.where}:{line}" if line else self.where)
        (self.removed if pol == "remove" else self.entries).append(e)


class _Mapping(list):
    """A YAML mapping with line numbers: [(key, value, line), ...]."""


class _Seq(list):
    """A YAML sequence with line numbers: [(value, line), ...]."""


def _items(obj: object) -> Optional[List[Tuple[Any, Any, Optional[int]]]]:
    if isinstance(obj, _Mapping):
        return list(obj)
    if isinstance(obj, Mapping):
        return [(k, v, None) for k, v in obj.items()]
    return None


def _seq(obj: object) -> Optional[List[Tuple[Any, Optional[int]]]]:
    if isinstance(obj, _Seq):
        return list(obj)
    if isinstance(obj, (list, tuple)) and not isinstance(obj, _Mapping):
        return [(v, None) for v in obj]
    return None


def _read_file(path: Path, allow_remove: bool) -> _Reader:
    where = str(path)
    try:
        if path.is_symlink() and not path.exists():
            raise ListError(f"{where}: is a symbolic link to {os.readlink(path)!r}, which does not exist")
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ListError(f"{where}: is {size} bytes; an op list must be under {MAX_BYTES} bytes")
        raw = path.read_bytes()
    except ListError:
        raise
    except FileNotFoundError:
        raise ListError(f"{where}: no such op-list file; check the path given to lists= or {ENV_VAR}") from None
    except OSError as e:
        raise ListError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ListError(f"{where}: is not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    return _read_text(text, where, allow_remove)


def _read_text(text: str, where: str, allow_remove: bool) -> _Reader:
    try:
        # Composing (not constructing) keeps line numbers and never builds
        # Python objects from tags; the C loader is much faster when present.
        root = yaml.compose(text, Loader=_SAFE_LOADER)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise ListError(f"{where}{line}: malformed YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ListError(f"{where}: malformed YAML: {e}") from None
    reader = _Reader(where, allow_remove)
    if root is None:
        return reader  # an empty file changes nothing
    reader.read_node(root)
    return reader


def _read_source(src: ListSource, allow_remove: bool) -> _Reader:
    if isinstance(src, Mapping):
        reader = _Reader("<lists dict>", allow_remove)
        reader.read(src, None)
        return reader
    if isinstance(src, (str, os.PathLike)):
        return _read_file(Path(src), allow_remove)
    raise ListError(f"lists= takes a YAML path, a dict, or a list of them; got {type(src).__name__}")


def _lists_root() -> "Traversable":
    """Where the shipped lists are: the ``amp_patch.lists`` package an install
    makes of the top-level ``lists/``, or that folder itself in a checkout used
    from ``PYTHONPATH`` without installing."""
    try:
        return resources.files(__name__.partition(".")[0] + ".lists")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "lists"


def default_files() -> List[Tuple[str, str]]:
    """``(file name, text)`` of every shipped default list, in a stable order."""
    root = _lists_root()
    return sorted((p.name, p.read_text(encoding="utf-8")) for p in root.iterdir() if p.name.endswith(".yaml"))


def _check_conflicts(entries: Sequence[Entry], problems: List[str]) -> None:
    by_key: Dict[Tuple[str, str], List[Entry]] = {}
    for e in entries:
        for other in by_key.get(e.key, ()):
            if e.overlaps(other):
                what = "is listed twice" if other.policy == e.policy else f"is under two policies ({other.policy!r} at {other.source})"
                problems.append(f"{e.source}: {e.namespace}.{e.policy} {e.name!r} {what}; keep one, or give them disjoint 'when' conditions")
                break
        by_key.setdefault(e.key, []).append(e)


def normalize_sources(lists: object) -> List[ListSource]:
    """``lists=`` plus ``$AMP_PATCH_LISTS`` as an ordered list of sources."""
    out: List[ListSource] = []
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        out.extend(p for p in env.split(os.pathsep) if p)
    if lists is None:
        return out
    if isinstance(lists, (str, os.PathLike, Mapping)):
        return out + [lists]
    if isinstance(lists, (list, tuple)):
        return out + list(lists)
    raise ListError(f"lists= takes a YAML path, a dict, or a list of them; got {type(lists).__name__}")


@dataclasses.dataclass(frozen=True)
class OpTable:
    """The merged lists: every entry, with the override that put it there."""

    entries: Tuple[Entry, ...]

    def resolve(self, dtype: torch.dtype, device: str = "cpu") -> Dict[Tuple[str, str], Entry]:
        """The entry that applies to each op for this dtype and device.

        Under BF16 a ``banned`` op runs in FP32, as CPU autocast does.
        """
        dname = "bfloat16" if dtype == torch.bfloat16 else "float16"
        out: Dict[Tuple[str, str], Entry] = {}
        for e in self.entries:
            if e.applies(dname, device) and op_exists(e.namespace, e.name):
                if e.policy == "banned" and dname == "bfloat16":
                    e = dataclasses.replace(e, policy="float")
                out[e.key] = e
        return out

    def missing(self) -> List[Entry]:
        """Optional entries whose op this torch version lacks."""
        return [e for e in self.entries if not op_exists(e.namespace, e.name)]


#: Tensor methods and the operators that run the same op: ``a - b`` is patched
#: as ``__sub__`` (``1 - b`` as ``__rsub__``), but torch reports it as ``sub``
OPERATOR_FORMS: Dict[str, Tuple[str, ...]] = {
    "add": ("__add__", "__radd__"), "sub": ("__sub__", "__rsub__"), "rsub": ("__rsub__",),
    "mul": ("__mul__", "__rmul__"), "div": ("__truediv__", "__rtruediv__"),
    "true_divide": ("__truediv__", "__rtruediv__"), "matmul": ("__matmul__", "__rmatmul__"),
    "pow": ("__pow__", "__rpow__"),
}


def inplace_name(name: str) -> Optional[str]:
    """The in-place form of op ``name`` by torch's naming, or None.

    ``exp`` -> ``exp_``, ``__pow__`` -> ``__ipow__``; reflected (``__rpow__``)
    and in-place names have none.
    """
    if name.startswith("__") and name.endswith("__"):
        dunder = f"__i{name[2:]}"
        return dunder if dunder in INPLACE_DUNDERS else None
    if name.startswith("_") or name.endswith("_"):
        return None
    return name + "_"


#: policies whose in-place forms are implied (sequence ops have none; a banned
#: op's in-place form would be as unsafe, and none exists)
_INPLACE_POLICIES = ("half", "float", "promote")


def _implied_inplace(entries: Sequence[Entry], removed: set) -> List[Entry]:
    """Entries for the in-place forms of listed ops that no list names.

    The wrapper of an in-place op keeps its receiver's dtype, so the policy
    copied from the out-of-place op only decides what happens to a half
    receiver under ``float`` (refused: it cannot become FP32 in place).
    """
    listed = {e.key for e in entries}
    out = []
    for e in entries:
        if e.policy not in _INPLACE_POLICIES:
            continue
        name = inplace_name(e.name)
        if name is None or (e.namespace, name) in listed or (e.namespace, name) in removed:
            continue
        if not op_exists(e.namespace, name):
            continue
        out.append(dataclasses.replace(
            e, name=name, optional=False, why=f"in-place form of {e.name}", derived_from=e.name,
        ))
    return out


@functools.lru_cache(maxsize=1)
def _shipped() -> Tuple[Tuple[str, ...], Tuple[Entry, ...]]:
    """The shipped lists, parsed once per process: every ``initialize`` and
    launcher start reads them, and they do not change while it runs."""
    problems: List[str] = []
    entries: List[Entry] = []
    for fname, text in default_files():
        r = _read_text(text, f"lists/{fname}", allow_remove=False)
        problems += r.problems
        _check_conflicts(r.entries, problems)
        entries += r.entries
    _check_conflicts(entries, problems)
    return tuple(problems), tuple(entries)


def collect_problems(sources: Sequence[ListSource], include_defaults: bool = True) -> Tuple[List[str], OpTable]:
    """Read defaults then each override; return every problem and the merged table."""
    problems: List[str] = []
    entries: List[Entry] = []
    removed: set = set()
    if include_defaults:
        shipped_problems, shipped = _shipped()
        problems += shipped_problems
        entries += shipped
    for src in sources:
        try:
            r = _read_source(src, allow_remove=True)
        except ListError as e:
            problems.append(str(e))
            continue
        problems += r.problems
        _check_conflicts(r.entries, problems)
        if include_defaults:
            listed = {e.key for e in entries} | {e.key for e in _implied_inplace(entries, removed)}
            for e in r.removed:
                if e.key not in listed:
                    problems.append(
                        f"{e.source}: {e.namespace}.remove {e.name!r} is on no list, so there is nothing to remove; "
                        f"drop the entry (`amp-patch lists` shows every listed op)"
                    )
        # An override moves each op it names out of every other list.
        touched = {e.key for e in r.entries} | {e.key for e in r.removed}
        entries = [e for e in entries if e.key not in touched] + r.entries
        removed = (removed - {e.key for e in r.entries}) | {e.key for e in r.removed}
    return problems, OpTable(tuple(entries) + tuple(_implied_inplace(entries, removed)))


def load(lists: object = None) -> OpTable:
    """The default lists merged with ``lists=`` and ``$AMP_PATCH_LISTS``.

    Raises:
        ListError: naming every problem found, before anything is patched.
    """
    problems, table = collect_problems(normalize_sources(lists))
    if problems:
        head = "invalid op list" if len(problems) == 1 else f"{len(problems)} problems in op lists"
        raise ListError(f"{head}:\n  " + "\n  ".join(problems))
    return table
