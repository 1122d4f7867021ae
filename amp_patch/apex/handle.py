"""Apex's 2018 handle API: ``handle = amp.init()``, ``handle.scale_loss``, ``handle.wrap_optimizer``.

The first apex.amp (2018) had no ``amp.initialize``: ``amp.init()`` patched
torch's functions (what O1 does now) and returned a handle whose
``scale_loss(loss, optimizer)`` scaled one loss, or whose
``wrap_optimizer(optimizer, num_loss)`` gave an optimizer with its own
``scale_loss(loss)`` per loss and a ``step()`` that skipped on overflow.
Later Apex releases made ``handle.scale_loss`` raise; scripts written in 2018
still call it. Here ``amp.init()`` starts an O1 run (``amp_patch.initialize``
with no model) and every optimizer a handle sees joins it on first use
(``adopt_optimizer``), so the scaling, unscaling and skipping are amp_patch's.

``amp.register_*_function`` calls made before ``amp.init()`` are honoured, as
they are before ``amp.initialize``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from .. import frontend, oplists
from ..base import running
from ..base.errors import ConfigError, StateError
from ..run.session import Session
from ..scaling import scale_loss as _scale_loss
from . import lists as apex_lists
from .amp_state import Handle, _amp_state

__all__ = ["AmpHandle", "NoOpHandle", "OptimWrapper", "init"]


def _banned_as_float() -> dict:
    """An op-list override that runs every banned op in FP32 (``allow_banned=True``)."""
    out: dict = {}
    for e in oplists.load().entries:
        if e.policy == "banned":
            out.setdefault(e.namespace, {}).setdefault("float", []).append(e.name)
    return out


def init(
    enabled: bool = True,
    loss_scale: object = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    *,
    half_dtype: object = None,
) -> "AmpHandle | NoOpHandle":
    """apex.amp.init (2018): patch torch's functions for mixed precision and return a handle.

    Args:
        enabled: False returns a handle that does nothing.
        loss_scale: ``"dynamic"`` or a fixed scale.
        enable_caching: accepted; amp_patch always caches the half copy of a
            weight within a step.
        verbose: log every cast (amp_patch's verbosity 2).
        allow_banned: run the ops amp refuses in FP16 (binary_cross_entropy)
            in FP32 instead of raising.
        half_dtype: amp_patch's keyword, not Apex's (default: FP16 on CUDA,
            BF16 on CPU).

    Returns:
        A handle with ``scale_loss``, ``wrap_optimizer``, ``disable_casts``,
        ``is_active`` and ``_deactivate``.

    Example::

        from apex import amp
        handle = amp.init()
        with handle.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    """
    if not enabled:
        return NoOpHandle()
    overrides = {} if loss_scale == "dynamic" else {"loss_scale": loss_scale}
    # the script's edits of Apex's lists (amp.lists), then allow_banned's override
    given = [o for o in (apex_lists.override(), _banned_as_float() if allow_banned else None) if o is not None]
    lists = given or None
    frontend.initialize_as_apex(None, None, opt_level="O1", half_dtype=half_dtype, lists=lists,
                                verbosity=2 if verbose else _amp_state.verbosity, options=overrides)
    return AmpHandle(running.session())


class AmpHandle(Handle):
    """The handle ``amp.init()`` returns, bound to the run it started.

    Its ``_deactivate()`` ends that run (``deinitialize``).
    """

    def __init__(self, amp: "Session"):
        super().__init__(amp)
        self._default_scaler_used = True

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """Scale ``loss`` for ``optimizer``; on exit its gradients are unscaled and
        checked, and an overflow makes the next ``optimizer.step()`` a skip.

        Raises:
            StateError: after ``wrap_optimizer`` (Apex's rule: use the wrapped
                optimizer's ``scale_loss``).
        """
        if not self.is_active():
            yield loss
            return
        if not self._default_scaler_used:
            raise StateError("after handle.wrap_optimizer(), call optimizer.scale_loss(loss) on the wrapped optimizer")
        with _scale_loss(loss, frontend.adopt_optimizer(optimizer)) as scaled:
            yield scaled

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> "OptimWrapper":
        """An optimizer with ``scale_loss(loss)`` for each of ``num_loss`` losses per step."""
        self._default_scaler_used = False
        return OptimWrapper(optimizer, self, num_loss)

    def _deactivate(self) -> None:
        """End the handle's run: torch's functions are its own again."""
        if self._session() is not None:
            frontend.deinitialize()


class NoOpHandle:
    """The handle of ``amp.init(enabled=False)``: everything runs as written."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: object) -> Iterator[torch.Tensor]:
        yield loss

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> "OptimWrapper":
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    disable_casts = _disable_casts

    def _deactivate(self) -> None:
        pass

    def _clear_cache(self) -> None:
        pass

    has_cache = False
    verbose = False


class OptimWrapper:
    """``handle.wrap_optimizer``'s result: one loss scale per loss, a step that skips on overflow.

    Call ``scale_loss`` once for each of the ``num_loss`` losses (in order),
    then ``step()``. Every other attribute is the optimizer's.

    Example::

        optimizer = handle.wrap_optimizer(optimizer, num_loss=2)
        with optimizer.scale_loss(loss_a) as scaled:
            scaled.backward()
        with optimizer.scale_loss(loss_b) as scaled:
            scaled.backward()
        optimizer.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, handle: "AmpHandle | NoOpHandle", num_loss: int):
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ConfigError(f"wrap_optimizer: num_loss={num_loss!r} must be an integer >= 1")
        self._optimizer = optimizer
        self._amp_handle = handle
        self._num_loss = num_loss
        self._loss_idx = 0
        if handle.is_active():
            frontend.adopt_optimizer(optimizer)
            handle._amp.add_losses(num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """Scale the next of this step's losses with its own loss scale."""
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise StateError(
                f"scale_loss was called {self._loss_idx + 1} times since the last step, but the optimizer was "
                f"wrapped with num_loss={self._num_loss}; call step() after the last loss, or wrap with a larger num_loss"
            )
        with _scale_loss(loss, self._optimizer, loss_id=self._loss_idx) as scaled:
            yield scaled
        self._loss_idx += 1

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Step the optimizer (skipped when any of this step's losses overflowed)."""
        self._loss_idx = 0
        if closure is not None and self._amp_handle.is_active():
            raise NotImplementedError("The `closure` argument is unsupported by the amp optimizer wrapper.")
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return repr(self._optimizer)

    def state_dict(self) -> dict:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self._optimizer.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        self._optimizer.add_param_group(param_group)
