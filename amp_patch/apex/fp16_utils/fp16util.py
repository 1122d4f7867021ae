"""Stands in for ``apex.fp16_utils.fp16util``: making a model half precision by
hand, and the manual master-weight recipe.

``network_to_half`` / ``FP16Model`` cast a model to FP16 for good, as Apex did
(plain ``.half()`` and ``.data`` swaps, no hooks, nothing to undo), keeping
affine batchnorm layers in FP32. amp_patch's own conversion
(``precision/model.py``) belongs to an ``initialize`` session, which hooks the
model and undoes the cast at ``deinitialize``, so it is not used here. ``prep_param_lists``,
``model_grads_to_master_grads`` and ``master_params_to_model_params`` are the
by-hand form of what ``FP16_Optimizer`` automates: FP32 copies of the model's
parameters that the script's own optimizer steps. They are plain lists the
script owns, so amp_patch's ``MasterWeights`` (which swaps masters into an
optimizer's ``param_groups``) does not apply; the copies run as torch
multi-tensor ops.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

Tensor = torch.Tensor

#: Apex's name for torch's in-place clip (it once chose between two torch spellings)
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def _is_affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True


def _half(t: Tensor) -> Tensor:
    # Apex made every input .half(); integer inputs (token ids) pass, as an
    # embedding cannot take FP16 indices
    return t.half() if t.is_floating_point() else t


class tofp16(nn.Module):
    """A module whose forward is ``input.half()`` for a floating ``input`` (an
    integer one passes unchanged): the first layer ``network_to_half`` adds.

    Example::

        model = nn.Sequential(tofp16(), net.half())
    """

    def forward(self, input: Tensor) -> Tensor:
        return _half(input)


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Put every affine batchnorm layer of ``module`` back in FP32, in place.

    Batchnorm statistics lose too much in FP16; torch's batchnorm kernels take
    an FP16 input with FP32 weights and statistics.

    Args:
        module: a model, usually just made ``.half()``.

    Returns:
        ``module`` itself.

    Example::

        model = BN_convert_float(model.half())
    """
    for m in module.modules():
        if _is_affine_batchnorm(m):
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``network`` in FP16 (affine batchnorm kept FP32), behind a ``tofp16`` input cast.

    The result is ``nn.Sequential(tofp16(), network)``, so its ``state_dict``
    keys start with ``"1."``, as Apex's did. ``network`` is converted in place.

    Args:
        network: the FP32 model.

    Example::

        model = network_to_half(resnet50())
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    """
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``module``'s own floating parameters (and their gradients) and
    buffers to ``dtype``, in place; its children are left alone.

    Args:
        module: the module whose direct parameters and buffers change.
        dtype: the floating dtype to convert to.

    Example::

        convert_module(model.fc, torch.half)
    """
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            p.data = p.data.to(dtype)
        if p.grad is not None and p.grad.is_floating_point():
            p.grad.data = p.grad.data.to(dtype)
    for b in module.buffers(recurse=False):
        if b.is_floating_point():
            b.data = b.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Convert every module of ``network`` to ``dtype`` in place, except affine batchnorm.

    Recurrent layers re-pack their weights afterwards (``flatten_parameters``).

    Args:
        network: the model.
        dtype: the floating dtype to convert to.

    Returns:
        ``network`` itself.

    Example::

        model = convert_network(model, torch.half)
    """
    for m in network.modules():
        if _is_affine_batchnorm(m):
            continue
        convert_module(m, dtype)
        if isinstance(m, nn.RNNBase):
            m.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to FP16 (affine batchnorm kept FP32), taking FP32 inputs.

    Floating inputs are made FP16 on the way in; integer inputs (token ids)
    pass unchanged.

    Args:
        network: the FP32 model, converted in place and kept as ``self.network``.

    Example::

        model = FP16Model(net)
        out = model(torch.randn(8, 16))     # out is FP16
    """

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        return self.network(*(_half(t) for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """FP32 master copies of ``model``'s trainable parameters, for a script's own optimizer.

    Args:
        model: the (half-precision) model.
        flat_master: make one flat FP32 master holding every parameter, with a
            gradient buffer of its size, instead of one master per parameter.

    Returns:
        ``(model_params, master_params)``: the model's parameters that require
        grad, and their FP32 masters (a list of one tensor when ``flat_master``).

    Example::

        model_params, master_params = prep_param_lists(model)
        optimizer = torch.optim.SGD(master_params, lr=0.1)
        (loss * 128).backward()
        model_grads_to_master_grads(model_params, master_params)
        for m in master_params:
            m.grad.mul_(1 / 128)
        optimizer.step()
        master_params_to_model_params(model_params, master_params)
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        flat = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        flat.grad = torch.zeros_like(flat)
        return model_params, [flat]
    masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (FP32) gradients.

    Args:
        model_params: the first list ``prep_param_lists`` returned.
        master_params: the second one.
        flat_master: as given to ``prep_param_lists``.

    A master whose parameter has no gradient gets none (``None``); in the flat
    master its slice is zero.

    Example::

        model_grads_to_master_grads(model_params, master_params)
    """
    if flat_master:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        master_params[0].grad.copy_(_flatten_dense_tensors(grads))
        return
    pairs = []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        pairs.append((master.grad, model.grad))
    if pairs:
        torch._foreach_copy_([m for m, _ in pairs], [g for _, g in pairs])


@torch.no_grad()
def master_params_to_model_params(model_params: Sequence[Tensor], master_params: Sequence[Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the (stepped) FP32 masters into the model's parameters, rounding to their dtype.

    Args:
        model_params: the first list ``prep_param_lists`` returned.
        master_params: the second one.
        flat_master: as given to ``prep_param_lists``.

    Example::

        optimizer.step()
        master_params_to_model_params(model_params, master_params)
    """
    if flat_master:
        master_params = _unflatten_dense_tensors(master_params[0].detach(), model_params)
    if model_params:
        torch._foreach_copy_(list(model_params), [m.detach() for m in master_params])


def to_python_float(t: Any) -> float:
    """A one-element tensor's value as a Python number (``t.item()``).

    Example::

        running_loss += to_python_float(loss)
    """
    if hasattr(t, "item"):
        return t.item()
    return t[0]
