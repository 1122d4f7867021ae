"""Writes a script makes to a half model's weights between steps reach the FP32
masters (O2/O5): ``p.data.clamp_(-c, c)`` as the original WGAN clips its
critic, edits under ``torch.no_grad()``, EMA swaps through ``.data``.

An in-place edit under ``no_grad`` bumps the parameter's version counter,
which ``WeightWrites`` compares; a write through ``.data`` bumps none. So
while masters exist, ``nn.Parameter.data`` is a property that notes which
model parameters handed out their data or had it replaced (``touched``); it
reads and writes exactly what torch's own attribute does. Before a step each
noted parameter whose half values differ from its master rounded to half
gives the master those elements (``WeightWrites.take``).
Undone with the session: the property goes once no masters are watched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch

if TYPE_CHECKING:
    from .master_parts import WeightWrites

_DATA = torch._C.TensorBase.__dict__["data"]  # torch's own getset descriptor
_Parameter = torch.nn.Parameter
#: id(half model parameter) -> the masters that back it, while a session runs
WATCHED: Dict[int, "WeightWrites"] = {}


def _get(self: torch.Tensor) -> torch.Tensor:
    ww = WATCHED.get(id(self))
    if ww is not None:
        ww.touched.add(id(self))
    return _DATA.__get__(self)


def _set(self: torch.Tensor, value: torch.Tensor) -> None:
    _DATA.__set__(self, value)
    ww = WATCHED.get(id(self))
    if ww is not None:
        ww.touched.add(id(self))


DATA = property(_get, _set, doc=_DATA.__doc__)


def watch(ww: "WeightWrites", half: torch.Tensor) -> None:
    """Note ``.data`` reads and writes of ``half`` into ``ww.touched`` from now on."""
    if not WATCHED and "data" not in vars(_Parameter):
        _Parameter.data = DATA  # type: ignore[assignment]
    WATCHED[id(half)] = ww


def unwatch(half: torch.Tensor) -> None:
    """Stop watching ``half``; the property goes with the last watched parameter."""
    WATCHED.pop(id(half), None)
    if not WATCHED and vars(_Parameter).get("data") is DATA:
        del _Parameter.data
