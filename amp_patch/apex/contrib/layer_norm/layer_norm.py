"""``apex.contrib.layer_norm.layer_norm``: Apex's ``FastLayerNorm``, a layer
norm over the last dimension whose output has the weight's dtype (Apex's
``fast_layer_norm`` kernel writes in the weight's type), computed in FP32 by
``apex.normalization``'s stand-in. Under autocast the input and parameters
are first cast to the autocast dtype, as Apex's ``_cast_if_autocast_enabled``."""
from __future__ import annotations

from typing import Any

import torch
from torch.nn import init

from ...normalization.fused_layer_norm import FusedLayerNormAffineMixedDtypesFunction

__all__ = ["FastLayerNorm", "FastLayerNormFN"]


class FastLayerNormFN(FusedLayerNormAffineMixedDtypesFunction):
    """``FastLayerNormFN.apply(x, gamma, beta, epsilon, memory_efficient=False)``:
    layer norm of ``x`` over ``gamma``'s size, in ``gamma``'s dtype.

    Example::

        y = FastLayerNormFN.apply(x, ln.weight, ln.bias, 1e-5)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float,
                memory_efficient: bool = False) -> torch.Tensor:
        return FusedLayerNormAffineMixedDtypesFunction.forward(ctx, x, gamma, beta, (gamma.numel(),), epsilon)


class FastLayerNorm(torch.nn.Module):
    """Apex's ``FastLayerNorm(hidden_size, eps=1e-5, memory_efficient=False)``:
    ``weight`` (ones) and ``bias`` (zeros) of ``hidden_size``; the output in
    the weight's dtype.

    Example::

        from apex.contrib.layer_norm import FastLayerNorm
        ln = FastLayerNorm(1024)
        y = ln(torch.randn(8, 16, 1024))
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, memory_efficient: bool = False):
        super().__init__()
        self.epsilon = eps
        self.memory_efficient = memory_efficient
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FastLayerNormFN.apply(x, self.weight, self.bias, self.epsilon, self.memory_efficient)
