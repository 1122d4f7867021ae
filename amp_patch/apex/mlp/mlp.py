"""``apex.mlp.mlp``: Apex's ``MLP``, a stack of linear layers each followed
by the activation (the last one too, as Apex's kernel), on ``torch.nn.functional``;
its autograd function ``MlpFunction`` and ``mlp_function``.

``MlpFunction`` stands in for Apex's ``mlp_cuda`` kernel: ``MlpFunction.apply(bias,
activation, input, *weights, *biases)`` with ``bias`` 1 or 0 and ``activation`` 0
(none), 1 (ReLU) or 2 (sigmoid). Like that kernel it runs in the dtype of
``input`` whatever casting is on (so its saved tensors and its backward agree),
and its backward computes every gradient from the saved layer outputs, as the
kernel's did. Scripts that call ``MlpFunction.forward(ctx, ...)`` and
``MlpFunction.backward(ctx, grad)`` themselves, from an autograd function of
their own, get the same.
"""
from __future__ import annotations

import contextlib
import math
from copy import copy
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ...patching.wrappers import pop_disabled, push_disabled

__all__ = ["MLP", "MlpFunction", "mlp_function"]

_ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2}
Tensor = torch.Tensor


@contextlib.contextmanager
def _as_kernel(device: str) -> Iterator[None]:
    """No casting inside: neither torch's autocast nor amp_patch's patched functions."""
    autocast_off = (torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device)
                    else contextlib.nullcontext())
    with autocast_off:
        push_disabled()
        try:
            yield
        finally:
            pop_disabled()


def _layers(bias: int, args: Sequence[Tensor]) -> Tuple[Tensor, List[Tensor], List[Optional[Tensor]]]:
    """``(input, weights, biases)`` of ``args``, as Apex's kernel splits them."""
    if len(args) < 2:
        raise ValueError("MlpFunction: pass the input and at least one weight: apply(bias, activation, input, "
                         "*weights, *biases)")
    if bias and len(args) % 2 == 0:
        raise ValueError(f"MlpFunction: with bias, pass the input, then one weight and one bias per layer; got "
                         f"{len(args) - 1} tensors after the input")
    n = (len(args) - 1) // 2 if bias else len(args) - 1
    x, weights = args[0], list(args[1:n + 1])
    biases: List[Optional[Tensor]] = list(args[n + 1:]) if bias else [None] * n
    if x.dim() != 2:
        raise ValueError(f"MlpFunction: the input must be 2-D (batch, features), as Apex's kernel reads it; "
                         f"got shape {tuple(x.shape)}")
    return x, weights, biases


def _check_activation(activation: int) -> None:
    if activation not in (0, 1, 2):
        raise ValueError(f"MlpFunction: activation must be 0 (none), 1 (relu) or 2 (sigmoid), not {activation!r}")


class MlpFunction(torch.autograd.Function):
    """Apex's ``MlpFunction``: ``MlpFunction.apply(bias, activation, input,
    *weights, *biases)``, the whole MLP in one autograd node.

    Layer ``i`` computes ``y = act(x @ weights[i].T + biases[i])``, the last
    layer included. ``input`` is 2-D ``(batch, in_features)``; ``weights[i]``
    is ``(out_i, in_i)``. Everything is computed in ``input``'s dtype (other
    operands are converted to it, as Apex's kernel took one dtype).

    Args (of ``apply``):
        bias: 1 (or True) when ``biases`` follow the weights, 0 otherwise.
        activation: 0 none, 1 ReLU, 2 sigmoid.
        *args: the input, the weights, then the biases.

    Raises:
        ValueError: an input that is not 2-D, an activation code other than
            0, 1 or 2, or a number of tensors that does not split into
            weights (and biases).

    Example::

        from apex.mlp import MlpFunction
        y = MlpFunction.apply(1, 1, x, w0, w1, b0, b1)
    """

    @staticmethod
    def forward(ctx: Any, bias: int, activation: int, *args: Tensor) -> Tensor:
        _check_activation(activation)
        x, weights, biases = _layers(bias, args)
        dtype = x.dtype
        outputs = []
        with _as_kernel(x.device.type):
            y = x
            for w, b in zip(weights, biases):
                y = F.linear(y, w.to(dtype), None if b is None else b.to(dtype))
                if activation == 1:
                    y = torch.relu(y)
                elif activation == 2:
                    y = torch.sigmoid(y)
                outputs.append(y)
        if hasattr(ctx, "save_for_backward"):
            ctx.save_for_backward(*args)
        else:  # a plain object passed to forward by hand
            ctx.saved_tensors = args
        ctx.outputs = outputs
        ctx.bias = bias
        ctx.activation = activation
        return outputs[-1]

    @staticmethod
    def backward(ctx: Any, grad_o: Tensor) -> Tuple[Optional[Tensor], ...]:
        args = ctx.saved_tensors
        x, weights, biases = _layers(ctx.bias, args)
        outputs = ctx.outputs
        dtype = x.dtype
        grad_ws: List[Tensor] = []
        grad_bs: List[Tensor] = []
        with _as_kernel(x.device.type):
            grad = grad_o.to(dtype)
            for i in range(len(weights) - 1, -1, -1):
                y = outputs[i]
                if ctx.activation == 1:
                    grad = grad * (y > 0).to(dtype)
                elif ctx.activation == 2:
                    grad = grad * (y * (1 - y))
                inp = outputs[i - 1] if i > 0 else x
                grad_ws.append(grad.t().mm(inp.to(dtype)))
                if ctx.bias:
                    grad_bs.append(grad.sum(0))
                grad = grad.mm(weights[i].to(dtype))
        del ctx.outputs
        grads = [grad] + grad_ws[::-1] + grad_bs[::-1]
        # each gradient in its tensor's own dtype
        return (None, None, *(g.to(t.dtype) for g, t in zip(grads, args)))


def mlp_function(bias: int, activation: int, *args: Tensor) -> Tensor:
    """``MlpFunction.apply(bias, activation, *args)``, with the tensors first cast
    to the autocast dtype when autocast is on for their device, as Apex's
    ``mlp_function`` does.

    Example::

        y = mlp_function(1, 1, x, *mlp.weights, *mlp.biases)
    """
    device = args[0].device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        args = tuple(t.to(dtype) if t.is_floating_point() else t for t in args)
        with torch.autocast(device, enabled=False):
            return MlpFunction.apply(bias, activation, *args)
    return MlpFunction.apply(bias, activation, *args)


class MLP(nn.Module):
    """Apex's ``MLP(mlp_sizes, bias=True, activation="relu")``: layer ``i`` maps
    ``mlp_sizes[i]`` to ``mlp_sizes[i + 1]`` with ``weight_i`` (and ``bias_i``),
    then the activation (``"relu"``, ``"sigmoid"`` or ``"none"``). Parameters
    are initialised as Apex's: weights ``N(0, sqrt(2 / (fan_in + fan_out)))``,
    biases ``N(0, sqrt(1 / fan_out))``.

    Raises:
        TypeError: for another activation, as Apex.

    Example::

        from apex.mlp import MLP
        mlp = MLP([1024, 1024, 1024])
        y = mlp(torch.randn(32, 1024))
    """

    def __init__(self, mlp_sizes: Sequence[int], bias: bool = True, activation: str = "relu"):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise TypeError("activation must be relu or none.")
        self.num_layers = len(mlp_sizes) - 1
        self.mlp_sizes = copy(mlp_sizes)
        self.bias = 1 if bias else 0
        self.activation = _ACTIVATIONS[activation]
        self.weights: List[nn.Parameter] = []
        self.biases: List[nn.Parameter] = []
        for i in range(self.num_layers):
            w = nn.Parameter(torch.empty(mlp_sizes[i + 1], mlp_sizes[i]))
            self.weights.append(w)
            setattr(self, f"weight_{i}", w)
            if self.bias:
                b = nn.Parameter(torch.empty(mlp_sizes[i + 1]))
                self.biases.append(b)
                setattr(self, f"bias_{i}", b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in self.weights:
            nn.init.normal_(weight, 0.0, math.sqrt(2.0 / float(weight.size(0) + weight.size(1))))
        for bias in self.biases:
            nn.init.normal_(bias, 0.0, math.sqrt(1.0 / float(bias.size(0))))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input
        for i, w in enumerate(self.weights):
            x = F.linear(x, w, self.biases[i] if self.bias else None)
            if self.activation == 1:
                x = F.relu(x)
            elif self.activation == 2:
                x = torch.sigmoid(x)
        return x

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
