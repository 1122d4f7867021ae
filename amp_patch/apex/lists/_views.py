"""The shipped op lists as Apex's Python lists, per namespace (shared by the
three ``*_overrides`` modules)."""
from __future__ import annotations

from typing import Any, Dict, List

from ... import oplists

#: Apex's list names and the amp_patch policy each holds
ATTRS = {"FP16_FUNCS": "half", "FP32_FUNCS": "float", "CASTS": "promote", "SEQUENCE_CASTS": "sequence_promote",
         "BANNED_FUNCS": "banned"}


def lists_of(namespace: str) -> Dict[str, List[Any]]:
    """``{Apex list name: its contents}`` for ``namespace``, from the shipped
    lists' entries that apply under FP16 (Apex's only half dtype)."""
    _, table = oplists.collect_problems([])
    out: Dict[str, List[Any]] = {attr: [] for attr in ATTRS}
    by_policy = {policy: attr for attr, policy in ATTRS.items()}
    for e in table.entries:
        if e.namespace != namespace or e.derived_from or not e.applies("float16", "cuda"):
            continue
        attr = by_policy[e.policy]
        item = (e.name, e.fix or e.why) if e.policy == "banned" else e.name
        if item not in out[attr]:
            out[attr].append(item)
    return out


def fill(module_globals: Dict[str, Any], namespace: str) -> None:
    """Give one ``*_overrides`` module its five Apex lists for ``namespace``
    and ``BASELINE``, the contents as shipped per policy, against which edits
    are read."""
    lists = lists_of(namespace)
    module_globals.update(lists)
    module_globals["BASELINE"] = {policy: list(lists[attr]) for attr, policy in ATTRS.items()}
