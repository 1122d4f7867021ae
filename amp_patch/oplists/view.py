"""What the op lists say, for people: the effective policy table and file checks.

Backs ``amp-patch lists`` and ``amp-patch check``. The policy shown for an op
is the one ``initialize`` would apply for the given dtype and device after
every override, with the file and line it came from.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import yaml

from .. import oplists
from ..config import default_half_dtype, parse_dtype


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
        chosen[e.key] = Row(e.namespace, e.name, policy, e.source, origin, note, missing)
    order = {ns: i for i, ns in enumerate(oplists.NAMESPACES)}
    rows = sorted(chosen.values(), key=lambda r: (order[r.namespace], r.op))
    return rows, dtype, device


def render(lists: Sequence[str] = (), half_dtype=None, device: Optional[str] = None, fmt: str = "table") -> str:
    """The effective policy as text: an aligned table or a YAML document.

    Example::

        print(render(["my_lists.yaml"], fmt="yaml"))
    """
    rows, dtype, device = effective(lists, half_dtype, device)
    dname = str(dtype).rpartition(".")[2]
    if fmt == "yaml":
        ops: Dict[str, Dict[str, dict]] = {}
        for r in rows:
            item = {"policy": r.policy, "source": r.source, "origin": r.origin}
            if r.note:
                item["note"] = r.note
            if r.missing:
                item["missing"] = True
            ops.setdefault(r.namespace, {})[r.op] = item
        doc = {"half_dtype": dname, "device": device, "torch": str(torch.__version__), "ops": ops}
        return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
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
