"""``apex.amp.scaler``: Apex's ``LossScaler`` as plain data, for checkpoints.

Apex's last ``FP16_Optimizer`` pickled an ``apex.amp.scaler.LossScaler`` into
its ``state_dict()``; ``torch.load(..., weights_only=False)`` of such a
checkpoint looks the class up by that name. This class has Apex's constructor
and fields, so the object unpickles here and ``FP16_Optimizer.load_state_dict``
(``amp_patch.apex.fp16_utils``) reads its scale. A running session's scalers are
``apex.amp._amp_state.loss_scalers`` (``amp_patch.apex.amp_state``), live views,
not this class.
"""
from __future__ import annotations

from typing import Optional, Union

__all__ = ["LossScaler"]


class LossScaler:
    """Apex's ``LossScaler`` fields: ``dynamic``, ``_loss_scale``, ``_unskipped``,
    ``_min_loss_scale``, ``_max_loss_scale``, ``_scale_seq_len``, ``_has_overflow``.

    Args:
        loss_scale: ``"dynamic"`` or a fixed scale.
        init_scale: a dynamic scaler's first scale (capped at ``max_loss_scale``).
        scale_factor: kept; Apex's scaler always grew and shrank by 2.
        scale_window: clean steps between growths.
        min_loss_scale, max_loss_scale: the dynamic scale's bounds.

    Example::

        from apex.amp.scaler import LossScaler
        ckpt = torch.load("apex_fp16_optimizer.pt", weights_only=False)   # holds one
        ckpt["optimizer"]["loss_scaler"].loss_scale()
    """

    def __init__(self, loss_scale: Union[str, float], init_scale: float = 2.0**16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0**24):
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else float(loss_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False

    def loss_scale(self) -> float:
        return self._loss_scale
