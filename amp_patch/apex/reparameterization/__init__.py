"""``apex.reparameterization``: ``apply_weight_norm`` / ``remove_weight_norm``
(Apex's removed weight normalisation), on ``torch.nn.utils.weight_norm``: the
same ``<name>_g`` / ``<name>_v`` parameters, recomputed before each forward."""
from __future__ import annotations

import warnings
from typing import List, Tuple

import torch
from torch import nn
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["apply_weight_norm", "remove_weight_norm"]


def _targets(module: nn.Module, name: str) -> List[Tuple[nn.Module, str]]:
    """``(owner module, parameter name)`` for ``name`` (dotted), or for every
    parameter of more than one dimension when ``name`` is empty, as Apex."""
    if name:
        owner, _, attr = name.rpartition(".")
        return [(module.get_submodule(owner) if owner else module, attr)]
    return [(module.get_submodule(n.rpartition(".")[0]) if "." in n else module, n.rpartition(".")[2])
            for n, p in module.named_parameters() if p.dim() > 1]


def apply_weight_norm(module: nn.Module, name: str = "", dim: int = 0, hook_child: bool = True) -> nn.Module:
    """Weight-normalise ``name`` of ``module`` (every parameter of more than one
    dimension when ``name`` is empty): ``w = g * v / ||v||`` over all dims but ``dim``.

    Example::

        from apex.reparameterization import apply_weight_norm
        m = apply_weight_norm(nn.Linear(20, 40), name="weight")
        m.weight_g.shape, m.weight_v.shape   # (40, 1), (40, 20)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation note, not the script's business
        for owner, attr in _targets(module, name):
            torch.nn.utils.weight_norm(owner, attr, dim)
    return module


def remove_weight_norm(module: nn.Module, name: str = "", remove_all: bool = False) -> nn.Module:
    """Undo ``apply_weight_norm``: ``name`` (or every weight-normalised parameter) becomes a plain parameter again.

    Example::

        remove_weight_norm(m)
    """
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, WeightNorm) and (
                    not name or name.rpartition(".")[2] == hook.name):
                torch.nn.utils.remove_weight_norm(sub, hook.name)
    return module
