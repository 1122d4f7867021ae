"""The steps an attached optimizer can take, tried in one order, in one place.

The scaler decides (``state.decide_skips`` leaves each handle a bool, or under
sync-free steps a 0-d device flag, 1.0 to skip); the chain steps, as
``torch.amp.GradScaler`` decides and the optimizer steps. Each link takes the
step, passes to the next, or, given a device flag it cannot read on the
device, asks for the decision on the host (``HOST``):

============  ==========================================  =======================
link          what it is                                  a device flag
============  ==========================================  =======================
``OnePass``   ``precision.onepass``: the C step, one pass  read in C (CPU tensors)
              per parameter (update, and the half copy)
``Compiled``  ``precision.compiled`` (``fused_update=True``)  asks for the host
``Torch``     the optimizer's own ``step``                as ``found_inf`` where
                                                          the optimizer takes it
                                                          (``fused=True``), else
                                                          asks for the host
============  ==========================================  =======================

With a closure (LBFGS) only ``Torch`` steps.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

import torch

if TYPE_CHECKING:
    from .state import Handle

Tensor = torch.Tensor
_NOTSET = object()

#: a link's answer besides taking the step: not mine, try the next one
PASS = "pass"
#: a link's answer to a device flag it cannot read there: decide on the host
HOST = "host"
Decision = Union[bool, Tensor]


def _one_pass(h: "Handle", skip: Decision, closure: bool, args: tuple, kwargs: dict) -> Tuple[Optional[str], Any]:
    k = h.onepass
    if k is None or closure:
        return PASS, None
    if isinstance(skip, Tensor):
        if skip.device.type != "cpu":
            return PASS, None
        plan = k.plan(flagged=True)
        if plan is None:
            return PASS, None
        if not k.takes_flag(plan):
            return HOST, None
        k.run(plan, skip=skip)
        return None, None
    return (None, None) if k.step() else (PASS, None)


def _compiled(h: "Handle", skip: Decision, closure: bool, args: tuple, kwargs: dict) -> Tuple[Optional[str], Any]:
    if h.compiled is None or closure:
        return PASS, None
    if isinstance(skip, Tensor):
        return HOST, None  # the compiled update decides on the host
    plan = h.compiled.plan()
    return (None, None) if plan is not None and h.compiled.run(plan) else (PASS, None)


def _torch(h: "Handle", skip: Decision, closure: bool, args: tuple, kwargs: dict) -> Tuple[Optional[str], Any]:
    opt = h.optimizer
    if not isinstance(skip, Tensor):
        out = h.originals["step"](*args, **kwargs)
    elif _reads_found_inf(h):
        # torch's fused optimizers skip on found_inf on the device, their step counts
        # unchanged (the attributes GradScaler sets; the gradients are unscaled already)
        saved = {k: vars(opt).get(k, _NOTSET) for k in ("grad_scale", "found_inf")}
        opt.grad_scale, opt.found_inf = None, skip
        try:
            out = h.originals["step"](*args, **kwargs)
        finally:
            for k, v in saved.items():
                if v is _NOTSET:
                    delattr(opt, k)
                else:
                    setattr(opt, k, v)
    else:
        return HOST, None
    if h.masters is not None:
        h.masters.refresh()  # the masters into the half model (a skipped step changes nothing)
    return None, out


def _reads_found_inf(h: "Handle") -> bool:
    """Whether the optimizer's step reads ``found_inf`` from its attributes: torch's
    contract for ``_step_supports_amp_scaling``, which ``GradScaler`` follows only
    where ``step`` takes no ``grad_scaler`` argument (an optimizer that takes one,
    as Apex's capturable ``FusedAdam`` does, reads the scaler instead). Asked once
    per optimizer."""
    known = h.reads_found_inf
    if known is None:
        opt = h.optimizer
        known = False
        if getattr(opt, "_step_supports_amp_scaling", False):
            try:
                known = "grad_scaler" not in inspect.signature(h.originals["step"]).parameters
            except (TypeError, ValueError):
                known = False
        h.reads_found_inf = known
    return known


#: the chain, in the order its links are tried
CHAIN = (_one_pass, _compiled, _torch)


def take(h: "Handle", skip: Decision, closure: bool, args: tuple, kwargs: dict) -> Tuple[bool, Any]:
    """Step ``h``'s optimizer under the decision ``skip`` (a bool that is False, or a
    device flag). Returns ``(True, the step's result)``, or ``(False, None)`` with
    nothing done when a link needs a device flag decided on the host."""
    for link in CHAIN:
        answer, out = link(h, skip, closure, args, kwargs)
        if answer is None:
            return True, out
        if answer == HOST:
            return False, None
    return False, None  # not reached: Torch takes every host decision
