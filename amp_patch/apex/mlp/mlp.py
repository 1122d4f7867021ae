"""``apex.mlp.mlp``: Apex's ``MLP``, a stack of linear layers each followed
by the activation (the last one too, as Apex's kernel), on ``torch.nn.functional``."""
from __future__ import annotations

import math
from copy import copy
from typing import List, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MLP"]

_ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}


class MLP(nn.Module):
    """Apex's ``MLP(mlp_sizes, bias=True, activation="relu")``: layer ``i`` maps
    ``mlp_sizes[i]`` to ``mlp_sizes[i + 1]`` with ``weight_i`` (and ``bias_i``),
    then the activation (``"relu"``, ``"sigmoid"`` or ``"none"``). Parameters
    are initialised as Apex's: weights ``N(0, sqrt(2 / (fan_in + fan_out)))``,
    biases ``N(0, sqrt(1 / fan_out))``.

    Raises:
        TypeError: for another activation, as Apex.

    Example::

        from apex.mlp import MLP
        mlp = MLP([1024, 1024, 1024])
        y = mlp(torch.randn(32, 1024))
    """

    def __init__(self, mlp_sizes: Sequence[int], bias: bool = True, activation: str = "relu"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise TypeError("activation must be relu or none.")
        self.num_layers = len(mlp_sizes) - 1
        self.mlp_sizes = copy(mlp_sizes)
        self.bias = 1 if bias else 0
        self.activation = _ACTIVATIONS[activation]
        self.weights: List[nn.Parameter] = []
        self.biases: List[nn.Parameter] = []
        for i in range(self.num_layers):
            w = nn.Parameter(torch.empty(mlp_sizes[i + 1], mlp_sizes[i]))
            self.weights.append(w)
            setattr(self, f"weight_{i}", w)
            if self.bias:
                b = nn.Parameter(torch.empty(mlp_sizes[i + 1]))
                self.biases.append(b)
                setattr(self, f"bias_{i}", b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in self.weights:
            nn.init.normal_(weight, 0.0, math.sqrt(2.0 / float(weight.size(0) + weight.size(1))))
        for bias in self.biases:
            nn.init.normal_(bias, 0.0, math.sqrt(1.0 / float(bias.size(0))))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input
        for i, w in enumerate(self.weights):
            x = F.linear(x, w, self.biases[i] if self.bias else None)
            if self.activation == 1:
                x = F.relu(x)
            elif self.activation == 2:
                x = torch.sigmoid(x)
        return x

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
