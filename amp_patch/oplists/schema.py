"""The op-list schema: the policies an op can have, and which op names are in-place.

Shared by the list loader (``oplists``) and the casting wrappers
(``patching.wrappers``), which import it from here.
"""
from __future__ import annotations

#: what an op list can ask for an op (``remove`` in an override takes an op off)
POLICIES = ("half", "float", "promote", "sequence_promote", "banned")

#: in-place operator dunders; ``name_`` methods are in-place by convention
INPLACE_DUNDERS = frozenset(
    "__i%s__" % op
    for op in ("add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")
)


def is_inplace(name: str) -> bool:
    """Whether the op ``name`` writes into its first argument."""
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


#: protocol methods that write into their receiver without the in-place naming:
#: a casting wrapper would write into a temporary copy, so no list may name them
PROTOCOL_WRITES = frozenset({"__setitem__", "__delitem__", "__set__"})
