"""Loss scaling: ``scale_loss``, the patched ``loss.backward()``, ``unscale_``,
the patched ``optimizer.step`` / ``zero_grad``, and amp_patch's state dict.

Each optimizer gets a ``Handle``, an explicit per-optimizer state machine (as
``torch.amp.GradScaler`` keeps one): after a backward of loss ``l`` its
gradients are *pending* (scaled by loss ``l``'s scale, and under O2 still in the
half model); ``transfer`` makes them *unscaled* (into the FP32 masters under
O2), checking them for inf/NaN on the device; the step asks for a *skip decision*.

Unscaling is deferred to the first moment true gradients are needed: the
step, ``unscale_``, ``master_params``, torch's clip functions, or a backward of
another loss into the same optimizer. So gradient accumulation unscales once,
there is one fused inf/NaN check per step over all gradients
(``torch._amp_foreach_non_finite_check_and_unscale_``), and the only host sync
is the step's skip decision, one per step for all losses together (all-reduced under
``torch.distributed``). A loss whose scaler is inactive (BF16, or a static
scale of 1.0) is neither scaled, unscaled nor checked.

The rule for the patched ``Tensor.backward``: a call on a one-element tensor,
with no explicit ``gradient``, outside ``scale_loss`` and outside
``disable_casts()``, is loss 0 of every attached optimizer, exactly as if it
were written ``with scale_loss(loss, all_optimizers): ...``. Anything else
(non-scalar outputs, explicit gradients, ``torch.autograd.grad``,
``torch.autograd.backward``) runs untouched.

The modules: ``state`` (the per-optimizer state machine and the loss
scalers of a run), ``optimizer`` (the patched optimizer methods), ``patches``
(the backward and clip patches), ``api`` (the public functions),
``checkpoint`` (amp_patch's state dict), ``scaler`` (one loss scale),
``leaves`` (gradients of tensors no attached optimizer owns) and ``fused``
(the fused O2/O5 update).
"""
from __future__ import annotations

from .api import master_params, scale_loss, unscale_, validate_options
from .checkpoint import counters, load_state_dict, state_dict

__all__ = ["counters", "load_state_dict", "master_params", "scale_loss", "state_dict", "unscale_", "validate_options"]
