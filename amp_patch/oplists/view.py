"""What the op lists say, for people: the effective policy table and file checks.

Backs ``amp-patch lists`` and ``amp-patch check``. The policy shown for an op
is the one ``initialize`` would apply for the given dtype and device after
every override, with the file and line it came from.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from .. import oplists
from ..config import default_half_dtype, parse_dtype
from .schema import POLICIES


@dataclasses.dataclass(frozen=True)
class Row:
    """One op's effective policy."""

    namespace: str
    op: str
    policy: str
    source: str  # file:line of the entry in force
    origin: str  # "default" or "override"
    note: str = ""  # e.g. "missing from torch 2.x", "banned under float16", "in-place form of exp"
    missing: bool = False
    derived_from: str = ""  # the out-of-place op this in-place form follows (no list names it)


def effective(lists: Sequence[str] = (), half_dtype=None, device: Optional[str] = None) -> Tuple[List[Row], torch.dtype, str]:
    """The effective policy of every listed op, after ``lists`` and ``$AMP_PATCH_LISTS``.

    Args:
        lists: override files, applied after ``$AMP_PATCH_LISTS``.
        half_dtype: the run's low-precision dtype (default: by device).
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA if present).

    Returns:
        ``(rows, dtype, device)``, rows sorted by namespace and op.

    Raises:
        ListError: every problem in the lists.

    Example::

        rows, dtype, device = effective(["my_lists.yaml"], "float16", "cuda")
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(half_dtype) if half_dtype is not None else default_half_dtype(device)
    dname = "bfloat16" if dtype == torch.bfloat16 else "float16"
    table = oplists.load(list(lists))
    defaults = {f"lists/{name}" for name, _ in oplists.default_files()}
    chosen: Dict[Tuple[str, str], Row] = {}
    for e in table.entries:
        if not e.applies(dname, device):
            continue
        missing = not oplists.op_exists(e.namespace, e.name)
        policy, note = e.policy, f"in-place form of {e.derived_from}" if e.derived_from else ""
        if policy == "banned" and dname == "bfloat16":
            policy, note = "float", "banned under float16"
        if missing:
            note = f"missing from torch {torch.__version__}; not patched"
        origin = "default" if e.source.rpartition(":")[0] in defaults else "override"
        chosen[e.key] = Row(e.namespace, e.name, policy, e.source, origin, note, missing, e.derived_from)
    order = {ns: i for i, ns in enumerate(oplists.NAMESPACES)}
    rows = sorted(chosen.values(), key=lambda r: (order[r.namespace], r.op))
    return rows, dtype, device


def render(lists: Sequence[str] = (), half_dtype=None, device: Optional[str] = None, fmt: str = "table") -> str:
    """The effective policy as text: an aligned table, or (``fmt="yaml"``) an
    op-list override file that sets it (``override_yaml``).

    Example::

        print(render(["my_lists.yaml"], fmt="yaml"))
    """
    rows, dtype, device = effective(lists, half_dtype, device)
    dname = str(dtype).rpartition(".")[2]
    if fmt == "yaml":
        return override_yaml(rows, dtype, device)
    head = ("namespace", "op", "policy", "source", "note")
    body = [(r.namespace, r.op, r.policy, f"{r.origin} {r.source}", r.note) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [f"# effective op policy for {dname} on {device} (torch {torch.__version__})"]
    for cells in [head, tuple("-" * w for w in widths), *body]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r.policy] = counts.get(r.policy, 0) + 1
    summary = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
    n_missing = sum(r.missing for r in rows)
    lines.append(f"# {len(rows)} ops: {summary}" + (f"; {n_missing} missing from this torch" if n_missing else ""))
    return "\n".join(lines) + "\n"


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _scalar(text: str) -> str:
    """``text`` as a YAML scalar: plain where YAML reads it back as the same string."""
    if _NAME.fullmatch(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _removed(rows: Sequence[Row], dtype: torch.dtype, device: str) -> List[Tuple[str, str]]:
    """The ops the shipped lists give a policy here that the effective table does
    not have: an override (``remove``) took them off; a file that sets the effective
    policy must take them off too."""
    dname = "bfloat16" if dtype == torch.bfloat16 else "float16"
    _, shipped = oplists.collect_problems([])
    kept = {(r.namespace, r.op) for r in rows}
    return sorted({e.key for e in shipped.entries if e.applies(dname, device)} - kept)


def override_yaml(rows: Sequence[Row], dtype: torch.dtype, device: str) -> str:
    """The effective policy ``rows`` as an op-list override file.

    ``amp-patch check`` accepts it, and ``--lists`` / ``initialize(lists=...)``
    loaded with it give the same policy for this dtype and device: every op
    under its policy, ``remove`` for the shipped ops an override took off, and
    ``optional: true`` for the ops this torch lacks. The in-place forms that
    follow their op (``exp_`` after ``exp``) are not listed: the loader derives
    them again. Where each policy came from (file and line) and the notes are
    YAML comments. Loaded under another dtype or device, the file sets these
    policies there too (the ``when`` conditions that chose them are not kept).
    """
    dname = str(dtype).rpartition(".")[2]
    followers: Dict[Tuple[str, str], List[str]] = {}
    for r in rows:
        if r.derived_from:
            followers.setdefault((r.namespace, r.derived_from), []).append(r.op)
    by_ns: Dict[str, Dict[str, List[Tuple[str, bool, str]]]] = {}
    for r in rows:
        if r.derived_from:
            continue
        notes = [f"{r.origin} {r.source}"]
        if r.note:
            notes.append(r.note)
        if (r.namespace, r.op) in followers:
            notes.append("in-place " + ", ".join(followers[(r.namespace, r.op)]) + " follows it")
        by_ns.setdefault(r.namespace, {}).setdefault(r.policy, []).append((r.op, r.missing, "; ".join(notes)))
    for ns, op in _removed(rows, dtype, device):
        why = "taken off by an override"
        by_ns.setdefault(ns, {}).setdefault("remove", []).append((op, not oplists.op_exists(ns, op), why))
    lines = [
        f"# The effective op policy for {dname} on {device} (torch {torch.__version__}), as an op-list",
        "# override: `amp-patch check` accepts this file, and --lists FILE or initialize(lists=FILE)",
        "# applies it. It sets every op below under every dtype and device; in-place forms that",
        "# follow their op (exp_ after exp) are derived again and not listed. After each op: where",
        "# its policy came from (default: the shipped lists; override: --lists or AMP_PATCH_LISTS).",
    ]
    for ns in oplists.NAMESPACES:
        policies = by_ns.get(ns)
        if not policies:
            continue
        lines.append(f"{_scalar(ns)}:")
        for policy in (*POLICIES, "remove"):
            ops = policies.get(policy)
            if not ops:
                continue
            lines.append(f"  {policy}:")
            for op, missing, comment in sorted(ops):
                if missing:
                    lines.append(f"    - name: {_scalar(op)}  # {comment}")
                    lines.append("      optional: true")
                else:
                    lines.append(f"    - {_scalar(op)}  # {comment}")
    return "\n".join(lines) + "\n"


def check(files: Sequence[str]) -> List[str]:
    """Validate override files against the defaults and this torch.

    Returns:
        every problem as ``file:line: key message``, with the nearest valid
        name where there is one; empty when the files are valid.

    Example::

        for line in check(["my_lists.yaml"]):
            print(line)
    """
    problems, _ = oplists.collect_problems([str(f) for f in files])
    return problems
