"""Stand-in for Apex's ``apex.parallel.LARC`` module: the ``LARC`` optimizer wrapper.

LARC (layer-wise adaptive rate control, https://arxiv.org/abs/1708.03888)
gives every parameter a learning rate from the ratio of its norm to its
gradient's norm. As in Apex, it does so by rescaling the gradients before
the wrapped optimizer's own ``step()``, so it wraps any torch optimizer.
The module keeps Apex's layout: ``from apex.parallel.LARC import LARC``.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["LARC"]


class LARC:
    """Wrap ``optimizer`` so that each parameter's step uses an adaptive rate.

    For a parameter ``p`` with gradient ``g``, weight decay ``wd`` and the
    group's ``lr``, ``step()`` computes ``local = trust_coefficient * |p| /
    (|g| + wd * |p| + eps)`` and replaces ``g`` with ``(g + wd * p) * s``,
    where ``s = min(local / lr, 1)`` with ``clip`` (the rate becomes
    ``min(local, lr)``) and ``s = local`` without (the rate becomes
    ``local * lr``). The weight decay is folded into the gradient this way,
    so the groups' ``weight_decay`` is set to 0 for the wrapped step and
    restored after it. A parameter or gradient of norm 0 is left as it is.

    Args:
        optimizer: the torch optimizer to wrap.
        trust_coefficient: the trust coefficient of the paper.
        clip: clip the adaptive rate at the optimizer's (True) or scale the
            optimizer's by it (False).
        eps: keeps the denominator away from 0.

    Example::

        from apex.parallel.LARC import LARC

        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6),
                         trust_coefficient=0.001, clip=False)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    @property
    def state(self) -> Dict[Any, Any]:
        return self.optim.state

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.optim.defaults

    def __repr__(self) -> str:
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}) of {self.optim!r}"

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def step(self) -> None:
        """Rescale the gradients, then step the wrapped optimizer."""
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        try:
            with torch.no_grad():
                for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                    group["weight_decay"] = 0
                    for p in group["params"]:
                        if p.grad is not None:
                            self._rescale(p, weight_decay, group["lr"])
            self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay

    def _rescale(self, p: torch.Tensor, weight_decay: float, lr: float) -> None:
        param_norm = torch.linalg.vector_norm(p)
        grad_norm = torch.linalg.vector_norm(p.grad)
        if param_norm == 0 or grad_norm == 0:
            return
        scale = self.trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + self.eps)
        if self.clip:
            scale = torch.clamp(scale / lr, max=1)
        p.grad.add_(p, alpha=weight_decay).mul_(scale)
