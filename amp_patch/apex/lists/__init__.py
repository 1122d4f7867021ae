"""``apex.amp.lists``: Apex's op lists as Python lists that scripts edit.

Apex kept its casting policy in ``apex/amp/lists/{functional,torch,tensor}_overrides.py``
and scripts changed it by editing those lists before ``amp.initialize``
(``functional_overrides.FP32_FUNCS.remove("softmax")``). Here each module
holds the same names (``FP16_FUNCS``, ``FP32_FUNCS``, ``CASTS``,
``SEQUENCE_CASTS``, ``BANNED_FUNCS``), filled from amp_patch's shipped YAML
lists (the entries that apply under FP16), and ``override()`` turns whatever a
script changed into the op-list override a YAML file would carry: an op put on
a list is listed under that policy (and so leaves its old list), an op taken
off every list is ``remove``d. ``amp.initialize`` and ``amp.init`` apply it,
so an edit changes the run's policy exactly as the same YAML override would.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ._views import ATTRS

__all__ = ["functional_overrides", "torch_overrides", "tensor_overrides", "override", "reset"]

#: each namespace's module; made on first use (``amp.lists.functional_overrides``),
#: so ``import amp_patch`` does not build lists that no script edits
_MODULES = {
    "torch.nn.functional": "functional_overrides",
    "torch": "torch_overrides",
    "torch.Tensor": "tensor_overrides",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES.values():
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _loaded() -> Iterator[Tuple[str, ModuleType]]:
    """``(namespace, module)`` of the list modules made so far: only those can hold edits."""
    for namespace, sub in _MODULES.items():
        module = sys.modules.get(f"{__name__}.{sub}")
        if module is not None:
            yield namespace, module


def _names(values: Iterable[Union[str, Tuple[str, str]]]) -> List[str]:
    """Op names of an Apex list (``BANNED_FUNCS`` holds ``(name, message)`` pairs)."""
    return [v[0] if isinstance(v, (tuple, list)) else v for v in values]


def override() -> Optional[Dict[str, Dict[str, List[str]]]]:
    """The op-list override equivalent to the scripts' edits of these lists, or None when unedited.

    Example::

        from apex import amp
        amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
        amp.lists.functional_overrides.FP16_FUNCS.append("softmax")
        amp.lists.override()   # {"torch.nn.functional": {"half": ["softmax"]}}
    """
    out: Dict[str, Dict[str, List[str]]] = {}
    for namespace, module in _loaded():
        now = {policy: _names(getattr(module, attr)) for attr, policy in ATTRS.items()}
        before = {policy: _names(names) for policy, names in module.BASELINE.items()}
        edits: Dict[str, List[str]] = {}
        placed = set()
        for policy, names in now.items():
            added = [n for n in dict.fromkeys(names) if n not in before[policy]]
            if added:
                edits[policy] = added
            placed.update(names)
        gone = [n for names in before.values() for n in names if n not in placed]
        if gone:
            edits["remove"] = list(dict.fromkeys(gone))
        if edits:
            out[namespace] = edits
    return out or None


def reset() -> None:
    """Put every list back as shipped (in place: references scripts hold stay valid).

    Example::

        amp.lists.reset()   # undo a script's edits before the next amp.initialize
    """
    for _, module in _loaded():
        for attr, policy in ATTRS.items():
            getattr(module, attr)[:] = module.BASELINE[policy]
