"""The loss scaler's state, carried in the optimizer's ``state_dict`` on the zero-code routes.

A script written for FP32 checkpoints its model and optimizer (Hugging Face's
``Trainer`` writes ``optimizer.pt``; most loops ``torch.save`` the two state
dicts) and knows nothing of ``amp_patch.state_dict()``. Resumed under the
launcher, its FP16 run would start again from the initial loss scale: the
first steps after the resume overflow and are skipped where the saved run
stepped, and the run no longer follows the one that never stopped.

So while the launcher runs a script, each optimizer it attaches writes
``amp_patch.state_dict()`` under the key ``"amp_patch"`` of its own
``state_dict()`` whenever a loss scaler is active (FP16, or a static scale other
than 1), and its ``load_state_dict()`` takes that key out and loads it. The
value is plain numbers, so ``torch.load``'s ``weights_only=True`` reads it, and
plain torch's ``load_state_dict``, with no amp_patch, ignores the extra key.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..base import running
from ..scaling import checkpoint

#: the key of ``optimizer.state_dict()`` that carries the scaler state
KEY = "amp_patch"


def _saved(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    amp = running.session()
    if amp is None or amp.handle_of(optimizer) is None or not any(s.active for s in amp.scaling.scalers):
        return None
    state_dict[KEY] = checkpoint.state_dict()
    return state_dict


def _loading(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    # torch hands the pre-hooks a shallow copy: taking the key out leaves the caller's dict whole
    state = state_dict.pop(KEY, None)
    if state is not None and running.session() is not None:
        checkpoint.load_state_dict(state, strict=False)
    return state_dict


class Carry:
    """The two hooks on one optimizer; calling it removes them."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.handles: List[Any] = [
            optimizer.register_state_dict_post_hook(_saved),
            optimizer.register_load_state_dict_pre_hook(_loading),
        ]

    def __call__(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
