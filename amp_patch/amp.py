"""apex.amp's API, served by amp_patch: ``from amp_patch import amp``.

Every name and signature here is Apex's, so code written for ``apex.amp``
runs after changing one import (or none, with the launcher or
``amp_patch.install_apex_alias()``)::

    from amp_patch import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()

The functions forward to amp_patch's own; this module only translates
Apex's conventions: ``enabled=False`` makes everything a pass-through,
``state_dict`` speaks Apex's checkpoint format (``loss_scaler0``, ...), a
later ``initialize`` follows Apex's "last call wins", ``_amp_state`` is
Apex's private state as a live view (``amp_patch.apex.amp_state``), and
``init`` is the 2018 handle API (``amp_patch.apex.handle``).
"""
from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import inspect
import logging
import sys
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar

import torch

from . import frontend as _frontend
from . import scaling
from .base import running
from .base.errors import ConfigError, KeywordError
from .config import parse as _parse
from .apex import amp_state as _amp_state_module
from .apex import handle as _handle_module
from .apex import lists as _lists_module
from .apex import scaler as _scaler_module
from .apex.amp_state import _amp_state
from .apex.handle import init
from .frontend import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

log = logging.getLogger("amp_patch")

#: Apex's ``apex.amp`` submodules, served by these modules (the alias serves
#: ``import apex.amp.frontend`` and the like from this table too)
SUBMODULES = {
    "_amp_state": _amp_state_module,
    "frontend": sys.modules[__name__],
    "handle": _handle_module,
    "scaler": _scaler_module,
    "lists": _lists_module,
    "amp": sys.modules[__name__],
}

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "disable_casts",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "init",
    "_amp_state",
]

#: Apex's ``apex.amp`` is a package: scripts read its ``__path__`` (DeepSpeed logs
#: it), and an import of one of its submodules amp_patch does not serve
#: (``apex.amp.opt``) reaches the apex alias, which names the replacement.
#: Its submodules are served by ``SUBMODULES``, never from a directory.
__path__: list = []

# None until initialize is called; False after initialize(enabled=False),
# which turns scale_loss, state_dict and load_state_dict into pass-throughs.
_enabled: Optional[bool] = None


def _passthrough() -> bool:
    return _enabled is False and running.session() is None


_F = TypeVar("_F", bound=Callable[..., Any])


def _keywords_checked(fn: _F) -> _F:
    """``fn``, whose call with a keyword it does not take raises ``KeywordError``
    (a ``TypeError``) naming the keyword and the nearest valid one, where Python
    would only say that the keyword is unexpected. The signature stays ``fn``'s."""
    params = inspect.signature(fn).parameters
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            word = unknown[0]
            near = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else f"it takes {', '.join(valid)}"
            raise KeywordError(f"amp.{fn.__name__}() got an unexpected keyword argument {word!r}; {hint}")
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


@_keywords_checked
def initialize(
    models: object,
    optimizers: object = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: object = None,
    patch_torch_functions: object = None,
    keep_batchnorm_fp32: object = None,
    master_weights: object = None,
    loss_scale: object = None,
    cast_model_outputs: object = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: float = 2.0**24,
    *,
    half_dtype: object = None,
) -> Any:
    """apex.amp.initialize: the same arguments, the same return value.

    Args:
        models: an ``nn.Module`` or a list of them.
        optimizers: an optimizer, a list of them, or None.
        enabled: False returns ``models`` (and ``optimizers``) untouched and
            makes ``scale_loss`` yield the loss unchanged, as in Apex.
        opt_level: ``"O0"`` ... ``"O3"`` as in Apex, plus ``"O4"``/``"O5"``
            (the BF16 forms of O1/O2) and ``"O6"``/``"O7"`` (O5 with FP8
            ``nn.Linear`` layers, and Adam's moments in FP8/BF16 at O7).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
        master_weights, loss_scale, cast_model_outputs: Apex's property
            overrides; None keeps the opt level's value. Strings such as
            ``"True"`` and ``"dynamic"`` are accepted as in Apex. Unlike
            Apex's O1, ``cast_model_outputs`` defaults to ``torch.float32`` at
            every level, so code written for FP32 outputs (``.numpy()``, which
            has no bfloat16) keeps working; pass the half dtype to keep half
            outputs.
        num_losses: how many losses get their own loss scaler (``loss_id``).
        verbosity: 0 silences the informational messages.
        min_loss_scale: floor of the dynamic loss scale (None: amp_patch's
            default, 1.0).
        max_loss_scale: ceiling of the dynamic loss scale.
        half_dtype: amp_patch's keyword, not Apex's: ``torch.float16`` or
            ``torch.bfloat16`` (default: FP16 on CUDA, BF16 on CPU; O4/O5 BF16).

    Calling it again works as in Apex, where the last call sets the
    properties and the loss scalers anew: a call with the running settings
    adds its models and optimizers to the run (those already in it stay as
    they are) and restarts the loss scalers with its ``num_losses``; a call
    with other settings (another opt level, say) ends the earlier run, with
    a warning saying what its models and optimizers went back to, and starts
    its own. ``amp_patch.initialize`` keeps its stricter rule.

    Set ``amp._amp_state.allow_incoming_model_not_fp32 = True`` first to
    pass a model that is already FP16 at O1; the optimizer then steps its
    FP16 parameters (with loss scaling), as Apex did.

    Returns:
        ``models`` or ``(models, optimizers)``, in the structure given.

    Example::

        from amp_patch import amp
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    """
    global _enabled
    if not enabled:
        _enabled = False
        cur = running.session()
        if cur is not None and cur.provisional is not None:
            # The script turned AMP off itself; its word beats the launcher's.
            log.info("amp_patch: the script called amp.initialize(enabled=False); mixed precision is off")
            _frontend.deinitialize()
        return models if optimizers is None else (models, optimizers)
    overrides: Dict[str, Any] = dict(
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        cast_model_outputs=torch.float32 if cast_model_outputs is None else cast_model_outputs,
        min_loss_scale=min_loss_scale,
    )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if _amp_state.allow_incoming_model_not_fp32:
        overrides["allow_half_params"] = True
    _amp_state.verbosity = verbosity
    out = _frontend.initialize_as_apex(
        models, optimizers, opt_level=opt_level, half_dtype=half_dtype,
        lists=_edited_lists(opt_level, patch_torch_functions), verbosity=verbosity,
        options=dict(num_losses=num_losses, max_loss_scale=max_loss_scale, **overrides),
    )
    _enabled = True
    return out


def _edited_lists(opt_level: object, patch_torch_functions: object) -> object:
    """The op-list override the script's edits of ``amp.lists`` amount to, for
    a level that patches functions (elsewhere Apex's lists did nothing either),
    after the launcher's own lists when it runs the script."""
    edits = _lists_module.override()
    if edits is None:
        return None
    try:
        extra = {} if patch_torch_functions is None else {"patch_torch_functions": patch_torch_functions}
        patches = _parse(opt_level, "cpu", **extra).patch_torch_functions
    except ConfigError:
        return None  # the call itself reports the bad opt level
    if not patches:
        return None
    # under the launcher, its own op lists stay, and the script's edits come after them
    cur = running.session()
    given = cur.provisional.lists if cur is not None and cur.provisional is not None else None
    if given is None:
        return edits
    return (list(given) if isinstance(given, (list, tuple)) else [given]) + [edits]


def scale_loss(
    loss: torch.Tensor,
    optimizers: object,
    loss_id: int = 0,
    model: object = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
):
    """apex.amp.scale_loss: a context manager yielding the scaled loss.

    On leaving the block the gradients are unscaled and checked, and the next
    ``optimizer.step()`` is armed to run or to be skipped. ``model`` and
    ``delay_overflow_check`` are accepted and unused, as in Apex.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer (or list) the loss's gradients feed.
        loss_id: which loss scaler (0 .. ``num_losses - 1``).
        model: unused.
        delay_unscale: leave the gradients scaled (gradient accumulation).
        delay_overflow_check: unused.

    Example::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    """
    if _passthrough():
        return contextlib.nullcontext(loss)
    return scaling.scale_loss(loss, optimizers, loss_id=loss_id, delay_unscale=delay_unscale)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """apex.amp.master_params: the parameters ``optimizer`` steps (FP32 masters under O2).

    Clip these, after ``scale_loss``'s block, to clip the true gradients.

    Example::

        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    if running.session() is None:
        # Before initialize, or with enabled=False: Apex yields the
        # optimizer's own parameters.
        return (p for group in optimizer.param_groups for p in group["params"])
    return scaling.master_params(optimizer)


def state_dict(destination: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """apex.amp.state_dict: ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``.

    Each entry also carries the rest of the scaler's state, and the dict may
    hold amp_patch's own keys; Apex-era code that reads or edits
    ``["loss_scaler0"]["loss_scale"]`` keeps working.

    Example::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, "checkpoint.pt")
    """
    if destination is None:
        destination = collections.OrderedDict()
    if _passthrough():
        return destination
    destination.update(scaling.state_dict())
    return destination


def load_state_dict(state_dict: Dict[str, Any]) -> None:
    """apex.amp.load_state_dict: restore the loss scalers from ``amp.state_dict()``.

    Accepts checkpoints written by Apex and by amp_patch. Call it after
    ``initialize``. As in Apex, a checkpoint with another number of loss
    scalers than ``num_losses`` loads its first ones, with a warning.

    Example::

        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
        amp.load_state_dict(torch.load("checkpoint.pt")["amp"])
    """
    if _passthrough():
        return
    scaling.load_state_dict(state_dict, strict=False)


def __getattr__(name: str) -> Any:
    # Apex's submodules that scripts reach through the package
    # (`apex.amp.frontend._amp_state`, `apex.amp.handle.AmpHandle`)
    if name in SUBMODULES:
        return SUBMODULES[name]
    raise AttributeError(f"module 'apex.amp' has no attribute {name!r}")
