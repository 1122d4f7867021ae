"""The loss of every backward amp_patch scales, for ``plot()`` and ``report()``.

The ``Tensor.backward`` patch (a plain ``loss.backward()``) and ``scale_loss``
hand the true loss, before any scaling, to ``record``, with the loss id and
the optimizer step it feeds. Nothing is read on the host then: the values stay
on the loss's device, and every ``CHUNK`` backwards they are stacked there and
copied to the host without blocking (``base.counts.HostCopies``); ``rows``
waits for what is still in flight. Recording adds no host synchronisation to
a step. Only the newest ``HISTORY_LENGTH`` are kept, as for
the loss-scale history.

A run whose ``Tensor.backward`` is not patched (O0, and O3 at the static scale
of 1, which leave torch untouched) records nothing here.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Deque, List, Optional, Tuple

import torch

from ..base.counts import HostCopies
from ..patching.wrappers import pop_disabled, push_disabled

if TYPE_CHECKING:
    from .state import Diagnostics

#: newest entries kept, as the loss scalers keep their history
HISTORY_LENGTH = 10_000
#: backwards recorded between two copies to the host
CHUNK = 256

Row = Tuple[int, int, float]  # (loss_id, step, loss)


class LossLog:
    """``(loss_id, step, loss)`` of the backwards of one session, newest last."""

    def __init__(self, maxlen: int = HISTORY_LENGTH):
        self._rows: Deque[Row] = collections.deque(maxlen=maxlen)
        self._pending: List[Tuple[int, int, torch.Tensor]] = []
        #: chunks on their way to the host: the ``(loss_id, step)`` of each value, in order
        self._copies = HostCopies()
        self._keys: Deque[List[Tuple[int, int]]] = collections.deque()
        #: backwards recorded so far (not bounded by ``maxlen``)
        self.count = 0

    def add(self, loss: torch.Tensor, loss_id: int, step: int) -> None:
        """Keep ``loss`` (a one-element floating-point tensor) for step ``step`` of loss ``loss_id``."""
        push_disabled()  # amp_patch's own bookkeeping: never cast, never counted in the op ledger
        try:
            with torch.no_grad():
                value = loss.detach().reshape(())
                if value._base is not None:  # a view would keep the tensor it views alive
                    value = value.clone()
            self._pending.append((loss_id, step, value))
            self.count += 1
            if len(self._pending) >= CHUNK:
                self._flush()
        finally:
            pop_disabled()

    def last(self) -> Optional[torch.Tensor]:
        """The newest loss recorded, as a one-element tensor on its device, or None."""
        if self._pending:
            return self._pending[-1][2]
        self._receive(wait=True)
        if self._rows:
            return torch.tensor(self._rows[-1][2])
        return None

    def _flush(self) -> None:
        """Stack the pending values per device and start their copy to the host."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        push_disabled()
        try:
            with torch.no_grad():
                by_device: dict = {}
                for lid, step, v in pending:
                    by_device.setdefault(v.device, []).append((lid, step, v))
                for group in by_device.values():
                    self._copies.post(torch.stack([v.float() for _, _, v in group]))
                    self._keys.append([(lid, step) for lid, step, _ in group])
        finally:
            pop_disabled()
        self._receive(wait=False)

    def _receive(self, wait: bool) -> None:
        for values in self._copies.drain(wait):
            keys = self._keys.popleft()
            self._rows.extend((lid, step, v) for (lid, step), v in zip(keys, values))

    def rows(self) -> List[Row]:
        """Every kept ``(loss_id, step, loss)``, oldest first (waits for the copies in flight)."""
        self._flush()
        self._receive(wait=True)
        return list(self._rows)


def log_of(diag: "Diagnostics") -> LossLog:
    """The loss log of one session's diagnostics (made on first use)."""
    log = diag.losses
    if log is None:
        log = diag.losses = LossLog()
    return log


def peek(diag: "Diagnostics") -> Optional[LossLog]:
    """The loss log of one session's diagnostics if it has recorded anything, else None."""
    return diag.losses


def record_loss(diag: "Diagnostics", loss: object, loss_id: int, step: int) -> None:
    """Record the true loss of a backward (called by the backward patch and ``scale_loss``).

    Anything but a one-element floating-point tensor (a non-scalar output, an
    integer tensor) is not a loss and is left out.
    """
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        log_of(diag).add(loss, loss_id, step)
