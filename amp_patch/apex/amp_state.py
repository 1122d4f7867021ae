"""``apex.amp._amp_state``: Apex's private state object, as a live view of amp_patch's.

Apex kept one ``AmpState`` object that its modules shared, and scripts reached
into it: ``amp._amp_state.loss_scalers[0].loss_scale()`` to log the scale,
``..._loss_scale = 2**20`` to set it, ``_amp_state.opt_properties.opt_level``
to see what ``initialize`` chose, ``_amp_state.handle._deactivate()`` to undo
O1's patches, ``_amp_state.allow_incoming_model_not_fp32 = True`` to train a
model that arrives in FP16. This module keeps nothing of its own beyond those
user-set flags: every read and write goes to the running session, so the
view can never disagree with what amp_patch does.

As in Apex, ``opt_properties``, ``loss_scalers`` and ``handle`` are absent
(``hasattr`` is False) until ``amp.initialize`` has run.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, ContextManager, Iterator, List, Optional, Union

import torch

from .. import frontend
from ..base import running
from ..run.session import Session
from ..scaling import master_params as _masters
from ..scaling import state as scaling_state
from ..scaling.scaler import LossScaler

log = logging.getLogger("amp_patch")

__all__ = ["AmpState", "Properties", "ScalerView", "master_params", "maybe_print", "warn_or_err", "_amp_state"]


def _running(what: str) -> "Session":
    amp = running.session()
    if amp is None:
        # AttributeError keeps Apex's `hasattr(_amp_state, "loss_scalers")` test working
        raise AttributeError(
            f"_amp_state.{what}: amp is not initialized; call amp.initialize(model, optimizer, opt_level=...) first"
        )
    return amp


#: each running loss scaler's Apex ``_overflow_buf``, made on first use
_OVERFLOW_BUFS: "weakref.WeakKeyDictionary[LossScaler, torch.Tensor]" = weakref.WeakKeyDictionary()


class ScalerView:
    """Apex's ``amp.scaler.LossScaler`` surface over one of amp_patch's loss scalers.

    ``loss_scale()``, ``_loss_scale`` (readable and writable), ``_unskipped``
    (clean steps since the last change), ``dynamic``, ``_min_loss_scale``,
    ``_max_loss_scale``, ``_scale_seq_len`` (the growth interval, writable),
    ``_overflow_buf``, ``_has_overflow`` and ``update_scale()`` read and write
    the running scaler of loss ``index``.

    Example::

        from apex import amp
        amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20
        print(amp._amp_state.loss_scalers[0].loss_scale())
    """

    def __init__(self, index: int):
        self._index = index

    def _scaler(self) -> "LossScaler":
        run = _running("loss_scalers").scaling
        if self._index >= len(run.scalers):
            raise IndexError(
                f"loss scaler {self._index} is gone: the last amp.initialize asked for num_losses={len(run.scalers)}"
            )
        return run.scalers[self._index]

    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._scaler().scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler().scale

    @_loss_scale.setter
    def _loss_scale(self, value: Union[float, torch.Tensor]) -> None:
        scaler = self._scaler()
        value = float(value.item() if isinstance(value, torch.Tensor) else value)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"_loss_scale={value!r}: a loss scale must be a finite number > 0")
        scaler.scale = value
        # a static scaler of 1.0 does no work; one given another scale starts scaling
        _running("loss_scalers").scaling.refresh_plain()

    @property
    def _unskipped(self) -> int:
        return self._scaler().growth_tracker

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._scaler().growth_tracker = int(value)

    @property
    def dynamic(self) -> bool:
        return self._scaler().dynamic

    @property
    def _min_loss_scale(self) -> float:
        return self._scaler().min_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler().max_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler().growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"_scale_seq_len={value!r}: the growth interval must be an int >= 1")
        self._scaler().growth_interval = value

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """Apex's overflow flag, a one-element int tensor that multi-tensor
        kernels set (``multi_tensor_applier(amp_C.multi_tensor_scale,
        scaler._overflow_buf, ...)``); ``update_scale()`` reads it. Scripts may
        replace it with their own, as Apex allowed."""
        scaler = self._scaler()
        buf = _OVERFLOW_BUFS.get(scaler)
        if buf is None:
            buf = _OVERFLOW_BUFS[scaler] = torch.zeros(1, dtype=torch.int)
        return buf

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(f"_overflow_buf must be a one-element tensor (an int flag), not {value!r}")
        _OVERFLOW_BUFS[self._scaler()] = value

    @property
    def _has_overflow(self) -> bool:
        """Whether ``_overflow_buf`` holds an overflow (asks the device)."""
        return bool(self._overflow_buf.reshape(-1)[0].item() != 0)

    def update_scale(self) -> bool:
        """Apex's ``LossScaler.update_scale()``: read ``_overflow_buf``, then move
        the running scale as Apex did (an overflow halves a dynamic scale, to no
        less than its floor, and restarts the count; ``_scale_seq_len`` clean
        updates double it, to no more than its ceiling), and clear the flag.

        Returns:
            True when the step must be skipped (a dynamic scaler saw an overflow).

        Example::

            scaler = amp._amp_state.loss_scalers[0]
            scaler._overflow_buf = overflow_buf       # set by amp_C.multi_tensor_scale
            if not scaler.update_scale():
                optimizer.step()
        """
        scaler = self._scaler()
        overflow = self._has_overflow
        scaler.update(overflow)
        self._overflow_buf.zero_()
        return overflow and scaler.dynamic

    def __repr__(self) -> str:
        try:
            s = self._scaler()
        except (AttributeError, IndexError) as e:
            return f"<apex LossScaler {self._index}: {e}>"
        return f"<apex LossScaler {self._index}: loss_scale={s.scale:g}, dynamic={s.dynamic}, unskipped={s.growth_tracker}>"


class Properties:
    """Apex's ``opt_properties``: what the last ``amp.initialize`` resolved, read-only.

    Attributes under Apex's names (``enabled``, ``opt_level``,
    ``cast_model_type``, ``patch_torch_functions``, ``keep_batchnorm_fp32``,
    ``master_weights``, ``loss_scale``) and Apex's ``options`` dict.
    """

    NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
             "master_weights", "loss_scale")

    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in self.NAMES}

    def __getattr__(self, name: str) -> Any:
        if name == "enabled":
            return True
        if name in self.NAMES:
            return getattr(_running("opt_properties").config, name)
        raise AttributeError(f"'Properties' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"opt_properties.{name} cannot be changed after amp.initialize; pass {name}={value!r} to amp.initialize"
        )


class Handle:
    """Apex's O1 handle: ``is_active()``, ``_deactivate()``, ``_disable_casts()``.

    ``_deactivate()`` takes amp_patch's function patches off (torch's
    functions are its own again, as Apex's ``_deactivate`` restored them);
    models, optimizers and loss scaling stay until ``deinitialize``.

    Args:
        amp: the session the handle belongs to, or None for whichever runs
            (``_amp_state.handle``).
    """

    has_cache = True

    def __init__(self, amp: Optional["Session"] = None):
        self._amp = amp

    def _session(self) -> Optional["Session"]:
        """The handle's session while it runs, else None."""
        amp = running.session()
        return amp if self._amp is None or amp is self._amp else None

    def is_active(self) -> bool:
        amp = self._session()
        return amp is not None and len(amp.patcher) > 0

    def _deactivate(self) -> None:
        amp = self._session()
        if amp is not None:
            amp.unpatch_functions()

    def _disable_casts(self) -> ContextManager[None]:
        return frontend.disable_casts()

    disable_casts = _disable_casts

    def _clear_cache(self) -> None:
        amp = self._session()
        if amp is not None:
            amp.cache.clear()

    @property
    def verbose(self) -> bool:
        amp = self._session()
        return amp is not None and amp.config.verbosity > 1


class AmpState:
    """Apex's ``_amp_state``: the flags a script sets, and live views of the run.

    ``allow_incoming_model_not_fp32``: set it before ``amp.initialize`` to
    accept a model whose parameters are already FP16 at O1; the optimizer
    then steps them as they are, as Apex did. ``hard_override`` and
    ``verbosity`` are kept for scripts that read or set them.
    """

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1

    @property
    def opt_properties(self) -> Properties:
        _running("opt_properties")
        return _PROPERTIES

    @property
    def loss_scalers(self) -> List[ScalerView]:
        run = _running("loss_scalers").scaling
        return [ScalerView(i) for i in range(len(run.scalers))]

    @property
    def handle(self) -> Handle:
        amp = _running("handle")
        if not amp.config.patch_torch_functions:
            raise AttributeError("_amp_state.handle: Apex makes the handle only at O1 (function patching)")
        return _HANDLE

    @property
    def min_loss_scale(self) -> float:
        return _running("min_loss_scale").scaling.scalers[0].min_scale

    @property
    def max_loss_scale(self) -> float:
        return _running("max_loss_scale").scaling.scalers[0].max_scale


_PROPERTIES = object.__new__(Properties)
_HANDLE = Handle()
_amp_state = AmpState()


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` steps: FP32 masters under O2 (``apex.amp._amp_state.master_params``)."""
    if running.session() is None:
        return (p for group in optimizer.param_groups for p in group["params"])
    return _masters(optimizer)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Apex's ``maybe_print``: a message unless ``verbosity`` is 0 (logged, on rank 0 when asked)."""
    if _amp_state.verbosity > 0 and (not rank0 or scaling_state.is_rank0()):
        log.info("%s", msg)


def warn_or_err(msg: str) -> None:
    """Apex's ``warn_or_err``: a warning under ``hard_override``, else RuntimeError."""
    if _amp_state.hard_override:
        log.warning("Warning:  %s", msg)
    else:
        raise RuntimeError(msg)
