"""What a copy of a converted (O2/O3/O5) model is: a plain FP32 model.

Training code copies models: an EMA or SWA copy (``copy.deepcopy(model)``,
``torch.optim.swa_utils.AveragedModel``), a frozen teacher, ``torch.save`` of
the whole module. A copy of the half-precision model amp_patch trains would
carry amp_patch's hooks without amp_patch's FP32 masters: its
``state_dict()`` would hand out new FP32 tensors instead of views of its
parameters, so an EMA update written as ``ema.state_dict()[k].copy_(...)``
would be thrown away, and an average kept in half precision loses every update
smaller than the half dtype's resolution (a decay of 0.999 in BF16 freezes).

So a deep copy, or a pickle, of any module of a converted model is an ordinary
FP32 module: each parameter holds its exact FP32 value (its master's where an
optimizer holds one), buffers have their dtypes from before ``initialize``,
and none of amp_patch's hooks come along. Its ``state_dict()`` tensors are
views of its parameters, as in plain torch, and it runs in FP32 (a copy is not
under amp_patch's management; pass it to ``initialize`` to train it in half).

It works through two instance attributes, ``__deepcopy__`` and
``__reduce_ex__``, which ``copy`` and ``pickle`` look up on the instance
before the class; ``deinitialize`` removes them with the rest of the
conversion.

A Hugging Face model's ``save_pretrained`` writes ``state_dict()`` (FP32
values) but records the dtype of the live parameters in its config, so
``from_pretrained`` would reload the checkpoint in half precision. A converted
model's ``save_pretrained`` (an instance attribute, too) writes the config
again with the dtype the model had before ``initialize``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

Tensor = torch.Tensor
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")
_KWARG_SETS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


#: hook classes every copy drops, whoever installed them (``drop_on_copy``)
_DROPPED: tuple = ()


def drop_on_copy(*hook_types: type) -> None:
    """Have every copy of a model drop hooks of ``hook_types`` (amp_patch's
    own hooks from outside the model conversion: the forward tracking of
    ``run.flight``)."""
    global _DROPPED
    _DROPPED = _DROPPED + tuple(t for t in hook_types if t not in _DROPPED)


class Plan:
    """For one converted model: where each tensor's FP32 value comes from."""

    def __init__(self, fp32_value: Callable[[Tensor], Optional[Tensor]], dtypes: Dict[Any, torch.dtype],
                 hook_types: tuple, exact_buffer: Callable[[nn.Module, str, Tensor], Optional[Tensor]]):
        self.fp32_value = fp32_value  # a parameter's exact FP32 value, or None
        self.exact_buffer = exact_buffer  # a buffer's exact value from before the cast, or None
        self.dtypes = dtypes  # id(parameter), or (id(module), buffer name) -> dtype before initialize
        self.hook_types = hook_types  # amp_patch's hook classes, dropped from copies (with ``drop_on_copy``'s)


class _DeepCopy:
    """``module.__deepcopy__``: a plain FP32 copy (see the module docstring)."""

    __slots__ = ("module", "plan")

    def __init__(self, module: nn.Module, plan: Plan):
        self.module, self.plan = module, plan

    def __call__(self, memo: Optional[dict] = None) -> nn.Module:
        memo = {} if memo is None else memo
        mod = self.module
        cls = type(mod)
        new = cls.__new__(cls)
        memo[id(mod)] = new
        state = {k: v for k, v in mod.__dict__.items() if not isinstance(v, _OURS)}
        new.__setstate__(copy.deepcopy(state, memo))
        with torch.no_grad():
            _to_fp32(mod, new, self.plan, memo)
        return new


class _Reduce:
    """``module.__reduce_ex__``: pickle (``torch.save(model)``) the plain FP32 copy."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, protocol: int) -> Union[str, Tuple[Any, ...]]:
        return copy.deepcopy(self.module).__reduce_ex__(protocol)


def _to_fp32(old_root: nn.Module, new_root: nn.Module, plan: Plan, memo: dict) -> None:
    """Give ``new_root`` (a fresh structural copy of ``old_root``) FP32 values and no amp_patch hooks.

    A parameter's FP32 value is its master's where an optimizer holds one, and
    the copy of the parameter stands for the master in ``memo`` too: a copy of
    the optimizer made in the same ``deepcopy`` (``copy.deepcopy((model,
    optimizer))``, in either order) then steps the copied model, as a deep
    copy of the pair made before ``initialize`` would.
    """
    for old, new in zip(old_root.modules(), new_root.modules()):
        for name, p in old._parameters.items():
            q = new._parameters.get(name)
            if p is None or q is None:
                continue
            value = plan.fp32_value(p)
            dtype = plan.dtypes.get(id(p))
            prior = memo.get(id(value)) if value is not None else None
            if isinstance(prior, nn.Parameter) and prior.shape == q.shape and prior.dtype == value.dtype:
                new._parameters[name] = prior  # the optimizer's copy came first: the model shares it
                continue
            if value is not None:
                q.data = value.detach().clone(memory_format=torch.preserve_format)
                memo[id(value)] = q
            elif dtype is not None and q.dtype != dtype:
                q.data = q.data.to(dtype)
            if q.grad is not None and q.grad.dtype != q.dtype:
                q.grad = q.grad.to(q.dtype)
        for name, b in old._buffers.items():
            dtype = plan.dtypes.get((id(old), name))
            nb = new._buffers.get(name)
            if nb is not None and dtype is not None and nb.dtype != dtype:
                exact = plan.exact_buffer(old, name, b)
                new._buffers[name] = exact.clone() if exact is not None else nb.to(dtype)
        for attr in _HOOK_DICTS:
            hooks = getattr(new, attr, None)
            if not hooks:
                continue
            for key in [k for k, h in hooks.items() if isinstance(getattr(h, "hook", h), plan.hook_types + _DROPPED)]:
                del hooks[key]
                for kw in _KWARG_SETS:
                    getattr(new, kw, {}).pop(key, None)


class _SavePretrained:
    """``model.save_pretrained``: the library's own, then the config's dtype
    put back to the one the model had before ``initialize``."""

    __slots__ = ("module", "dtype")

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype

    def __call__(self, save_directory: object, *args: Any, **kwargs: Any) -> Any:
        mod = self.module
        out = type(mod).save_pretrained(mod, save_directory, *args, **kwargs)
        config = mod.config
        name = str(self.dtype).split(".")[-1]
        changed = False
        for attr in ("dtype", "torch_dtype"):
            value = config.__dict__.get(attr)
            if value is not None and str(value).split(".")[-1] in _HALF_NAMES:
                setattr(config, attr, name)
                changed = True
        if changed and kwargs.get("is_main_process", True):
            config.save_pretrained(save_directory)
        return out


_HALF_NAMES = ("float16", "bfloat16")


_OURS = (_DeepCopy, _Reduce, _SavePretrained)


def install_save_pretrained(model: nn.Module, dtype: torch.dtype) -> None:
    """Give a Hugging Face model (one with ``config`` and ``save_pretrained``)
    a ``save_pretrained`` whose config records ``dtype``."""
    if callable(getattr(type(model), "save_pretrained", None)) and hasattr(model, "config"):
        model.__dict__["save_pretrained"] = _SavePretrained(model, dtype)


def _none(*args: object) -> None:
    return None


def install_hook_drop(model: nn.Module) -> None:
    """The copy rule of a model amp_patch did not convert (its tensors keep their
    dtypes): copies and pickles of it leave amp_patch's hooks behind
    (``drop_on_copy``'s types) and change nothing else."""
    install(model, Plan(_none, {}, (), _none))


def install(model: nn.Module, plan: Plan) -> None:
    """Make copies and pickles of every module of ``model`` plain FP32 modules."""
    for mod in model.modules():
        if "__deepcopy__" in mod.__dict__:
            continue
        mod.__dict__["__deepcopy__"] = _DeepCopy(mod, plan)
        mod.__dict__["__reduce_ex__"] = _Reduce(mod)


def remove(model: nn.Module) -> None:
    """Undo ``install``."""
    for mod in model.modules():
        d = mod.__dict__
        if isinstance(d.get("__deepcopy__"), _DeepCopy):
            del d["__deepcopy__"]
        if isinstance(d.get("__reduce_ex__"), _Reduce):
            del d["__reduce_ex__"]
        if isinstance(d.get("save_pretrained"), _SavePretrained):
            del d["save_pretrained"]

