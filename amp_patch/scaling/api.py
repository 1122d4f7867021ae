"""The public loss-scaling API: ``scale_loss``, ``unscale_``, ``master_params``."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator, List, Optional

import torch

from ..base import running
from ..base.eager import eager
from ..base.errors import ConfigError, StateError
from ..precision import master
from ..precision.optimizers import inner_optimizer
from . import patches
from .state import Handle, LossScaling, after_backward, arm, before_backward, loss_factor, transfer

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

Tensor = torch.Tensor

def current(what: str) -> Any:
    """The running session (``running.session``); StateError when none runs."""
    amp = running.session()
    if amp is None:
        raise StateError(f"amp_patch.{what} needs amp_patch.initialize(model, optimizer, opt_level=...) first")
    return amp


def _handles(scaling: LossScaling, optimizers: object, what: str) -> List[Handle]:
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    out = []
    for i, given in enumerate(opts):
        opt = inner_optimizer(given)
        if opt is None:
            raise ConfigError(f"amp_patch.{what}: optimizers[{i}] is a {type(given).__name__}, not a torch.optim.Optimizer")
        h = scaling.handle_of(opt)
        if h is None:
            raise StateError(
                f"amp_patch.{what}: this {type(opt).__name__} was not passed to initialize. Pass it there "
                f"(initialize(model, [opt1, opt2], ...)) or attach it with amp_patch.adopt_optimizer(opt)."
            )
        out.append(h)
    return out


def _scale_loss(
    loss: Tensor,
    optimizers: object,
    loss_id: int = 0,
    model: object = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """Scale a loss for backward; apex.amp's ``scale_loss``.

    Yields ``loss.float() * scale``. When the block exits, the gradients of
    ``optimizers``' parameters are unscaled in place (into the FP32 masters
    under O2) and checked for inf/NaN on the device, as Apex's exit did: code
    that reads ``.grad`` before the step sees true gradients. The next
    ``optimizer.step()`` of each runs or is skipped; an overflow in any
    backward since the last step skips it. Gradients already there from
    earlier backwards are true and stay so (the block's own are added to them
    once unscaled).

    Args:
        loss: the loss tensor.
        optimizers: the optimizer, or a list of them, this loss feeds.
        loss_id: which loss scaler to use, ``0 <= loss_id < num_losses``.
        model: ignored (apex.amp compatibility).
        delay_unscale: Apex's meaning: this exit leaves the gradients scaled,
            for a later ``scale_loss`` exit of the same loss (without it) to
            unscale the accumulated sum once; a step unscales them too.
        delay_overflow_check: ignored (apex.amp compatibility): the check
            never syncs with the host before the step.

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.
        ConfigError: ``loss_id`` out of range.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2")
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            with amp_patch.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), 1.0)
            optimizer.step()
    """
    run = current("scale_loss").scaling
    n = len(run.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ConfigError(f"scale_loss: loss_id={loss_id!r} must be an integer in [0, {n}); initialize(num_losses=...) sets how many")
    if not isinstance(loss, Tensor):
        raise ConfigError(f"scale_loss: the loss must be a tensor (the output of your loss function), got {type(loss).__name__} {loss!r}")
    handles = _handles(run, optimizers, "scale_loss")
    scaler = run.scalers[loss_id]
    flight = run.hooks.flight
    if not flight.enter("scale_loss"):
        raise StateError("amp_patch.scale_loss: amp_patch was deinitialized by another thread while this call waited")
    try:
        run.hooks.record_loss(loss, loss_id, scaler.steps)  # the true loss, for plot() and report()
        hooks: List[RemovableHandle] = []
        if scaler.active:
            hooks = patches.guard_foreign(run, loss, run.handles, loss_id)[1]
        before_backward(run, handles, loss_id)
        armed = None if delay_unscale else arm(run, handles, loss_id)
        try:
            yield loss.float() * loss_factor(scaler, loss) if scaler.active else loss.float()
        finally:
            for hook in hooks:
                hook.remove()
            after_backward(run, handles, loss_id, delay_unscale=bool(delay_unscale), armed=armed)
    finally:
        flight.leave()


class _ScaleLoss:
    """``scale_loss``'s context: entered and left eagerly under ``torch.compile`` (``base.eager``)."""

    __slots__ = ("_cm",)

    def __init__(self, cm: "contextlib.AbstractContextManager[Tensor]"):
        self._cm = cm

    @eager
    def __enter__(self) -> Tensor:
        return self._cm.__enter__()

    @eager
    def __exit__(self, *exc: object) -> Optional[bool]:
        return self._cm.__exit__(*exc)


@functools.wraps(_scale_loss)
@eager
def scale_loss(*args: Any, **kwargs: Any) -> _ScaleLoss:
    return _ScaleLoss(contextlib.contextmanager(_scale_loss)(*args, **kwargs))



def unscale_(optimizer: torch.optim.Optimizer) -> None:
    """Unscale ``optimizer``'s gradients now, e.g. to clip true gradients.

    Every scaled backward unscales its gradients as it ends, so this only has
    work to do after ``scale_loss(..., delay_unscale=True)``; it is kept for
    ``GradScaler``-style code. Idempotent. Under O2 the gradients are in the
    FP32 masters, which ``master_params`` yields.

    Args:
        optimizer: an optimizer passed to ``initialize`` (or ``adopt_optimizer``).

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.

    Example::

        loss.backward()
        amp_patch.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), 1.0)
        optimizer.step()
    """
    (h,) = _handles(current("unscale_").scaling, optimizer, "unscale_")
    transfer(h.run, h)


def master_params(optimizer: object) -> Iterator[Tensor]:
    """Yield the FP32 parameters ``optimizer`` steps: the masters under O2, its
    own parameters otherwise; apex.amp's ``master_params``.

    Iterating first unscales the optimizer's pending gradients, so clipping
    them clips true gradients at every opt level.

    Args:
        optimizer: an optimizer (or a list of them) passed to ``initialize``.

    Raises:
        StateError: before ``initialize``, or for an optimizer it did not attach.

    Example::

        loss.backward()
        torch.nn.utils.clip_grad_norm_(amp_patch.master_params(optimizer), max_norm=1.0)
        optimizer.step()
    """
    scaling = current("master_params").scaling
    opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return _unscaled_params(_handles(scaling, opts, "master_params"))


def _unscaled_params(handles: List[Handle]) -> Iterator[Tensor]:
    # A generator, so the unscale happens when the parameters are read.
    for h in handles:
        transfer(h.run, h)
    for h in handles:
        yield from master.params_of(h.optimizer)
