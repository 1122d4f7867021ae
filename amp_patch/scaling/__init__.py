"""Loss scaling: ``scale_loss``, the patched ``loss.backward()``, ``unscale_``,
the patched ``optimizer.step`` / ``zero_grad``, and amp_patch's state dict.

Each optimizer gets a ``Handle``, an explicit per-optimizer state machine (as
``torch.amp.GradScaler`` keeps one). No scaled gradient outlives the backward
that made it: at the end of every scaled backward (a patched
``loss.backward()``, the exit of ``scale_loss``) the gradients are unscaled in
place (into the FP32 masters under O2) and checked for inf/NaN in one fused
call (``torch._amp_foreach_non_finite_check_and_unscale_``) whose flag stays
on the device; the only host sync is the step's skip decision, one per step
for all losses together (all-reduced under ``torch.distributed``). Gradients
already in ``.grad`` are true, so a later scaled backward's are added to them
once unscaled. ``scale_loss(..., delay_unscale=True)`` leaves them scaled for
a later exit, or the step, to unscale once, as in Apex. A loss whose scaler is
inactive (BF16, or a static scale of 1.0) is neither scaled, unscaled nor
checked.

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
and ``leaves`` (gradients of tensors no attached optimizer owns). The fused
O2/O5 update lives with the masters, in ``amp_patch.precision.compiled``.
"""
from __future__ import annotations

from .api import master_params, scale_loss, unscale_
from .checkpoint import counters, load_state_dict, state_dict

__all__ = ["counters", "load_state_dict", "master_params", "scale_loss", "state_dict", "unscale_"]
