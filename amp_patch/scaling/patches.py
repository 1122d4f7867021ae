"""The torch functions loss scaling patches: ``Tensor.backward`` (a plain
``loss.backward()`` scaled for the attached optimizers) and torch's clip
functions (true gradients, the FP32 masters under O2)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List, Sequence, Tuple, Union

import torch
import wrapt

from .. import diagnostics
from ..base.eager import eager
from ..patching.wrappers import OpWrapper, switch
from . import leaves
from .state import Handle, LossScaling, after_backward, arm, before_backward, loss_factor, transfer_all

if TYPE_CHECKING:
    from types import ModuleType

    from torch.utils.hooks import RemovableHandle


Tensor = torch.Tensor

def _clip_targets() -> List[Tuple[ModuleType, str]]:
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg

    names = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
    return [(owner, n) for owner in (nnu, cg) for n in names if hasattr(owner, n)]


def _make_clip_patch(run: LossScaling):
    live = run.hooks.live

    def clip(wrapped, instance, args, kwargs):
        if not live():
            return wrapped(*args, **kwargs)
        transfer_all(run)
        if args:
            args = (_to_masters(run, args[0]),) + tuple(args[1:])
        elif "parameters" in kwargs:
            kwargs = dict(kwargs, parameters=_to_masters(run, kwargs["parameters"]))
        return wrapped(*args, **kwargs)

    return lambda original: OpWrapper(original, clip)


def _make_grad_scaler_patch(run: LossScaling):
    """``torch.amp.GradScaler.scale``: said once, the script's own scaler scales a
    loss amp_patch's scales too (``initialize`` added to a native-AMP loop that
    kept its GradScaler): every gradient is scaled twice, and FP16 overflows."""
    live = run.hooks.live

    def scale(wrapped, instance, args, kwargs):
        if (live() and not run.warned_grad_scaler and run.notices.verbosity and instance.is_enabled()
                and any(s.active for s in run.scalers)):
            run.warned_grad_scaler = True
            diagnostics.warn_user(
                "torch.amp.GradScaler.scale() under amp_patch's loss scaling: amp_patch scales the loss of "
                "loss.backward() itself, so this loss is scaled twice and its FP16 gradients overflow (every step "
                "skipped). Remove the GradScaler (scaler.scale(loss).backward() becomes loss.backward(), "
                "scaler.step(optimizer) becomes optimizer.step(); drop scaler.update()), or build it with "
                "enabled=False."
            )
        return wrapped(*args, **kwargs)

    return lambda original: wrapt.FunctionWrapper(original, scale)


def _to_masters(run: LossScaling, parameters: Union[Tensor, Iterable[object]]) -> List[object]:
    """Parameters with each half model parameter replaced by its FP32 master."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    out: List[object] = []
    for p in parameters:
        m = run.master_of(p) if isinstance(p, Tensor) else None
        out.append(p if m is None else m)
    return out



def ensure_patches(run: LossScaling) -> None:
    """Patch the torch functions this run needs now and does not have yet.

    ``Tensor.backward`` when a plain ``loss.backward()`` has work to do (loss
    scaling, FP32 masters to feed) or casts are on (its cast cache is emptied
    around every backward); ``clip_grad_norm_`` and its kin when gradients may
    be scaled or live in masters. A run with neither (O0; O3 at a static
    scale of 1) patches nothing on torch. Called again whenever that may
    change: an optimizer attached, a loss scale loaded.
    """
    run.refresh_plain()
    items = []
    if run.plain or run.config.patch_torch_functions:
        items.append((torch.Tensor, "backward", make_backward_patch(run)))
    if any(s.active for s in run.scalers) or run.config.master_weights:
        items += [(owner, name, _make_clip_patch(run)) for owner, name in _clip_targets()]
    if any(s.active for s in run.scalers):
        items.append((torch.amp.GradScaler, "scale", _make_grad_scaler_patch(run)))
    run.hooks.patch(items)  # skips what is patched already


def guard_foreign(run: LossScaling, loss: Tensor, handles: Sequence[Handle], loss_id: int) -> Tuple[bool, List["RemovableHandle"]]:
    """Before a scaled backward of loss ``loss_id``: hook every leaf it
    reaches that no attached optimizer owns so its gradient arrives unscaled
    (``leaves.py``), an overflow there counting against ``loss_id``. Returns
    whether the backward reaches an owned leaf, and the hook handles to remove
    after it. Warns once per run when such a leaf
    is a parameter, whose optimizer then steps without overflow checks."""
    reaches, foreign = leaves.split(loss, leaves.owned_ids(handles))
    if not foreign or not reaches:
        return reaches, []
    params = [t for t in foreign if isinstance(t, torch.nn.Parameter)]
    if params and not run.warned_foreign and run.notices.verbosity:
        run.warned_foreign = True
        diagnostics.warn_user(
            f"loss.backward() reached {len(params)} parameter(s) that no optimizer given to amp_patch owns "
            f"({leaves.describe(params)}). Their gradients are unscaled as they accumulate, so they hold "
            f"true values, but their optimizer's step() is not checked for inf/NaN gradients and is never "
            f"skipped. Pass that optimizer to initialize (initialize(models, [opt1, opt2], ...)) or attach "
            f"it with amp_patch.adopt_optimizer(optimizer)."
        )
    return reaches, leaves.unscale_on_arrival(foreign, run, loss_id)


def warn_unattached(run: LossScaling, loss: Tensor) -> None:
    """Once per run: a backward under an active loss scaler with no optimizer
    attached, so nothing scaled it (a model given to ``initialize`` alone, or a
    trainer that builds its optimizer after it)."""
    if not (run.scalers and run.scalers[0].active and run.notices.verbosity and loss.requires_grad):
        return
    run.warned_foreign = True
    dtype = str(run.config.half_dtype).replace("torch.", "")
    diagnostics.warn_user(
        f"loss.backward() ran with loss scaling on ({dtype}), but no optimizer is attached to amp_patch, so the "
        f"loss was not scaled: gradients too small for {dtype} become zero, and no step is checked for inf/NaN. "
        f"Pass the optimizer to initialize (model, optimizer = amp_patch.initialize(model, optimizer, ...)) or "
        f"attach it where it is built (optimizer = amp_patch.adopt_optimizer(optimizer)). A trainer that builds "
        f"its own (Hugging Face's Trainer) takes one built by you (Trainer(..., optimizers=(optimizer, None))), "
        f"or run the unchanged script with `amp-patch run`."
    )


def make_backward_patch(run: LossScaling):
    """The ``Tensor.backward`` patch: loss scaling for plain loops, and an empty cast cache.

    The cache is emptied before the backward too: the forward is over, and
    the half weight copies it holds would otherwise live until the end of
    the backward instead of being freed as autograd releases them. A forward
    recomputed inside the backward (activation checkpointing) casts again, to
    the same values.
    """
    sw = switch
    hooks = run.hooks
    flight, clear_cache, record_loss = hooks.flight, hooks.clear_cache, hooks.record_loss

    def make(original):
        def backward(wrapped, instance, args, kwargs):
            if not flight.enter("backward"):  # the session ended while this call waited for it
                return wrapped(*args, **kwargs)
            clear_cache()
            try:
                if not flight.inside("scale_loss") and not args and kwargs.get("gradient") is None:
                    # the true loss, for plot() and report() (scale_loss records its own)
                    record_loss(instance, 0, run.scalers[0].steps if run.scalers else 0)
                if (
                    not run.plain
                    or sw.off
                    or flight.inside("scale_loss")
                    or (args and args[0] is not None)
                    or kwargs.get("gradient") is not None
                    or instance.numel() != 1
                ):
                    if not run.handles and not run.warned_foreign:
                        warn_unattached(run, instance)
                    return wrapped(*args, **kwargs)
                handles = list(run.handles)
                scaler = run.scalers[0]
                leaf_hooks: List["RemovableHandle"] = []
                if scaler.active:
                    reaches, leaf_hooks = guard_foreign(run, instance, handles, 0)
                    if not reaches:
                        # nothing amp_patch unscales: the backward of a model no
                        # attached optimizer owns runs as written, unscaled
                        return wrapped(*args, **kwargs)
                before_backward(run, handles, 0)
                armed = arm(run, handles, 0)
                loss = instance.float() * loss_factor(scaler, instance) if scaler.active else instance
                try:
                    return original(loss, *args, **kwargs)
                finally:
                    for hook in leaf_hooks:
                        hook.remove()
                    after_backward(run, handles, 0, armed=armed)
            finally:
                clear_cache()
                flight.leave()

        return wrapt.FunctionWrapper(original, eager(backward))  # eager under torch.compile (base.eager)

    return make
