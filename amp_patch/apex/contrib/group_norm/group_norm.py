"""``apex.contrib.group_norm.group_norm``: Apex's NHWC ``GroupNorm`` with an
optional fused SiLU, on ``torch.nn.functional.group_norm`` (the fallback
Apex itself takes off its kernel's shapes): the input is computed in the
weight's dtype and the output returned in the input's."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor
from torch.nn import init

__all__ = ["GroupNorm"]


def torch_group_norm(x: Tensor, g: int, w: Optional[Tensor], b: Optional[Tensor], eps: float,
                     act: Optional[str] = "") -> Tensor:
    """Apex's fallback: group norm in the weight's dtype, then SiLU for ``act`` ``"silu"``/``"swish"``."""
    xdtype = x.dtype
    if w is not None and xdtype != w.dtype:
        x = x.to(w.dtype)
    y = torch.nn.functional.group_norm(x, g, w, b, eps)
    if act in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y.to(xdtype)


class GroupNorm(torch.nn.Module):
    """Apex's ``GroupNorm(num_groups, num_channels, eps=1e-5, affine=True,
    device=None, dtype=None, act=None)``: ``torch.nn.GroupNorm`` plus ``act``
    (``"silu"``/``"swish"`` fused after the norm); any memory format.

    Raises:
        ValueError: when ``num_channels`` is not divisible by ``num_groups``.

    Example::

        from apex.contrib.group_norm import GroupNorm
        gn = GroupNorm(32, 320, act="silu")
        y = gn(x.to(memory_format=torch.channels_last))
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device: Union[torch.device, str, None] = None, dtype: Optional[torch.dtype] = None, act: Optional[str] = None):
        super().__init__()
        if num_channels % num_groups != 0:
            raise ValueError("num_channels must be divisible by num_groups")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.act = act.lower() if act else act
        if affine:
            self.weight = torch.nn.Parameter(torch.empty(num_channels, device=device, dtype=dtype))
            self.bias = torch.nn.Parameter(torch.empty(num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return torch_group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self.act)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, act={self.act}"
