"""``apex.fused_dense.fused_dense``: Apex's fused linear layers, on
``torch.nn.functional.linear`` and ``gelu`` (exact erf GELU, as Apex's kernel).

``FusedDense(in, out, bias=True)`` is a linear layer; ``FusedDenseGeluDense(in,
intermediate, out)`` is ``linear2(gelu(linear1(x)))``. Under autocast the
inputs are cast to the autocast dtype first, as Apex's wrappers did.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["FusedDense", "FusedDenseGeluDense", "FusedDenseFunc", "DenseNoBiasFunc", "FusedDenseGeluDenseFunc"]


def _autocast(*tensors: Optional[torch.Tensor]) -> Any:
    """The tensors in the autocast dtype when autocast is on for their device, else as they are."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


class FusedDenseFunc:
    """``FusedDenseFunc.apply(input, weight, bias)``: ``input @ weight.T + bias``."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(input, weight, bias)


class DenseNoBiasFunc:
    """``DenseNoBiasFunc.apply(input, weight)``: ``input @ weight.T``."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(input, weight)


class FusedDenseGeluDenseFunc:
    """``FusedDenseGeluDenseFunc.apply(input, weight1, bias1, weight2, bias2)``:
    ``linear(gelu(linear(input, weight1, bias1)), weight2, bias2)``."""

    @staticmethod
    def apply(input: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor, weight2: torch.Tensor,
              bias2: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(input, weight1, bias1)), weight2, bias2)


def _fused_dense(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    args = _autocast(input, weight, bias)
    with torch.autocast(input.device.type, enabled=False):
        return FusedDenseFunc.apply(*args)


def _dense_no_bias(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    args = _autocast(input, weight)
    with torch.autocast(input.device.type, enabled=False):
        return DenseNoBiasFunc.apply(*args)


def _fused_dense_gelu_dense(input: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor, weight2: torch.Tensor,
                            bias2: torch.Tensor) -> torch.Tensor:
    args = _autocast(input, weight1, bias1, weight2, bias2)
    with torch.autocast(input.device.type, enabled=False):
        return FusedDenseGeluDenseFunc.apply(*args)


class FusedDense(nn.Module):
    """Apex's ``FusedDense(in_features, out_features, bias=True)``: ``nn.Linear``'s
    parameters (``weight``, ``bias``; ``bias`` is None without one).

    Example::

        from apex.fused_dense import FusedDense
        layer = FusedDense(1024, 4096)
        y = layer(x)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return _fused_dense(input, self.weight, self.bias)
        return _dense_no_bias(input, self.weight)


class FusedDenseGeluDense(nn.Module):
    """Apex's ``FusedDenseGeluDense(in_features, intermediate_features, out_features, bias=True)``:
    ``weight1``/``bias1`` then GELU then ``weight2``/``bias2``.

    Raises:
        ValueError: for ``bias=False`` (Apex's kernel needs both biases).

    Example::

        from apex.fused_dense import FusedDenseGeluDense
        ffn = FusedDenseGeluDense(1024, 4096, 1024)
    """

    def __init__(self, in_features: int, intermediate_features: int, out_features: int, bias: bool = True):
        super().__init__()
        if not bias:
            raise ValueError("DenseGeluDense module without bias is currently not supported")
        self.in_features, self.intermediate_features, self.out_features = in_features, intermediate_features, out_features
        self.weight1 = nn.Parameter(torch.empty(intermediate_features, in_features))
        self.bias1 = nn.Parameter(torch.empty(intermediate_features))
        self.weight2 = nn.Parameter(torch.empty(out_features, intermediate_features))
        self.bias2 = nn.Parameter(torch.empty(out_features))
        for w, b, fan_in in ((self.weight1, self.bias1, in_features), (self.weight2, self.bias2, intermediate_features)):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _fused_dense_gelu_dense(input, self.weight1, self.bias1, self.weight2, self.bias2)
