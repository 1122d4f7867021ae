"""Stand-in for Apex's ``fused_layer_norm_cuda`` extension, which Megatron-era
code loads with ``importlib.import_module("fused_layer_norm_cuda")`` and calls
from its own autograd functions.

Forward functions return ``[output, mean, invvar]`` (layer norm) or
``[output, invvar]`` (RMS norm): ``mean`` and ``invvar = 1 / sqrt(var + eps)``
(RMS: ``1 / sqrt(mean(x**2) + eps)``) per row of the ``n1 x n2`` view, FP32
for half inputs. Backward functions take them back and return the gradients
Apex's kernels return, computed in FP32 from the normalised input::

    xhat = (x - mean) * invvar        (RMS: x * invvar)
    gw   = dout * gamma               (dout without gamma)
    dx   = invvar * (gw - mean(gw) - xhat * mean(gw * xhat))   (RMS: no mean(gw) term)
    dgamma = sum over rows of dout * xhat;  dbeta = sum over rows of dout

With ``memory_efficient=True`` the fourth argument is the forward's output,
and ``xhat`` is recovered from it, as in Apex.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

Tensor = torch.Tensor
f32 = torch.float32

__all__ = ["forward", "forward_affine", "forward_affine_mixed_dtypes", "backward", "backward_affine",
           "rms_forward", "rms_forward_affine", "rms_forward_affine_mixed_dtypes", "rms_backward",
           "rms_backward_affine"]


def _rows(x: Tensor, normalized_shape: Sequence[int]) -> Tensor:
    n2 = math.prod(normalized_shape)
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != tuple(normalized_shape):
        raise RuntimeError(f"fused_layer_norm_cuda: input of shape {tuple(x.shape)} does not end in "
                           f"normalized_shape {tuple(normalized_shape)}")
    return x.reshape(-1, n2).to(f32)


def _stats_dtype(x: Tensor) -> torch.dtype:
    return f32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _forward(rms: bool, x: Tensor, normalized_shape: Sequence[int], gamma: Optional[Tensor], beta: Optional[Tensor],
             eps: float, out_dtype: torch.dtype) -> List[Tensor]:
    rows = _rows(x, normalized_shape)
    mean = rows.mean(1)
    var = rows.pow(2).mean(1) if rms else (rows - mean[:, None]).pow(2).mean(1)
    invvar = torch.rsqrt(var + eps)
    y = rows * invvar[:, None] if rms else (rows - mean[:, None]) * invvar[:, None]
    if gamma is not None:
        y = y * gamma.reshape(1, -1).to(f32)
    if beta is not None:
        y = y + beta.reshape(1, -1).to(f32)
    out = y.reshape(x.shape).to(out_dtype)
    stats = _stats_dtype(x)
    return [out, invvar.to(stats)] if rms else [out, mean.to(stats), invvar.to(stats)]


def _backward(rms: bool, dout: Tensor, mean: Optional[Tensor], invvar: Tensor, input_or_output: Tensor,
              normalized_shape: Sequence[int], gamma: Optional[Tensor], beta: Optional[Tensor],
              memory_efficient: bool) -> List[Tensor]:
    g = _rows(dout, normalized_shape)
    v = _rows(input_or_output, normalized_shape)
    inv = invvar.reshape(-1, 1).to(f32)
    w = None if gamma is None else gamma.reshape(1, -1).to(f32)
    if memory_efficient:  # v is the output: undo the affine step
        xhat = v if beta is None else v - beta.reshape(1, -1).to(f32)
        xhat = xhat if w is None else xhat / w
    elif rms:
        xhat = v * inv
    else:
        xhat = (v - mean.reshape(-1, 1).to(f32)) * inv
    gw = g if w is None else g * w
    dx = gw - xhat * (gw * xhat).mean(1, keepdim=True)
    if not rms:
        dx = dx - gw.mean(1, keepdim=True)
    out = [(inv * dx).reshape(input_or_output.shape).to(input_or_output.dtype)]
    if gamma is not None:
        out.append((g * xhat).sum(0).reshape(gamma.shape).to(gamma.dtype))
    if beta is not None:
        out.append(g.sum(0).reshape(beta.shape).to(beta.dtype))
    return out


def forward(input: Tensor, normalized_shape: Sequence[int], epsilon: float) -> List[Tensor]:
    """Layer norm without affine: ``[output, mean, invvar]``, the output in ``input``'s dtype."""
    return _forward(False, input, normalized_shape, None, None, epsilon, input.dtype)


def forward_affine(input: Tensor, normalized_shape: Sequence[int], gamma: Tensor, beta: Tensor,
                   epsilon: float) -> List[Tensor]:
    """Layer norm: ``[output, mean, invvar]``, the output in ``input``'s dtype.

    Example::

        import fused_layer_norm_cuda
        out, mean, invvar = fused_layer_norm_cuda.forward_affine(x, (512,), ln.weight, ln.bias, 1e-5)
    """
    return _forward(False, input, normalized_shape, gamma, beta, epsilon, input.dtype)


def forward_affine_mixed_dtypes(input: Tensor, normalized_shape: Sequence[int], gamma: Tensor, beta: Tensor,
                                epsilon: float) -> List[Tensor]:
    """``forward_affine`` with the output in ``gamma``'s dtype (Megatron's mixed form)."""
    return _forward(False, input, normalized_shape, gamma, beta, epsilon, gamma.dtype)


def backward(dout: Tensor, mean: Optional[Tensor], invvar: Tensor, input_or_output: Tensor,
             normalized_shape: Sequence[int], epsilon: float, memory_efficient: bool = False) -> Tensor:
    """The input's gradient of ``forward``."""
    return _backward(False, dout, mean, invvar, input_or_output, normalized_shape, None, None, memory_efficient)[0]


def backward_affine(dout: Tensor, mean: Optional[Tensor], invvar: Tensor, input_or_output: Tensor,
                    normalized_shape: Sequence[int], gamma: Tensor, beta: Tensor, epsilon: float,
                    memory_efficient: bool = False) -> List[Tensor]:
    """``[grad_input, grad_gamma, grad_beta]`` of ``forward_affine``.

    Example::

        dx, dw, db = fused_layer_norm_cuda.backward_affine(dy, mean, invvar, x, (512,), w, b, 1e-5)
    """
    return _backward(False, dout, mean, invvar, input_or_output, normalized_shape, gamma, beta, memory_efficient)


def rms_forward(input: Tensor, normalized_shape: Sequence[int], epsilon: float) -> List[Tensor]:
    """RMS norm without a scale: ``[output, invvar]``."""
    return _forward(True, input, normalized_shape, None, None, epsilon, input.dtype)


def rms_forward_affine(input: Tensor, normalized_shape: Sequence[int], gamma: Tensor, epsilon: float) -> List[Tensor]:
    """RMS norm: ``[output, invvar]``, the output in ``input``'s dtype."""
    return _forward(True, input, normalized_shape, gamma, None, epsilon, input.dtype)


def rms_forward_affine_mixed_dtypes(input: Tensor, normalized_shape: Sequence[int], gamma: Tensor,
                                    epsilon: float) -> List[Tensor]:
    """``rms_forward_affine`` with the output in ``gamma``'s dtype."""
    return _forward(True, input, normalized_shape, gamma, None, epsilon, gamma.dtype)


def rms_backward(dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: Sequence[int],
                 epsilon: float, memory_efficient: bool = False) -> Tensor:
    """The input's gradient of ``rms_forward``."""
    return _backward(True, dout, None, invvar, input_or_output, normalized_shape, None, None, memory_efficient)[0]


def rms_backward_affine(dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: Sequence[int],
                        gamma: Tensor, epsilon: float, memory_efficient: bool = False) -> List[Tensor]:
    """``[grad_input, grad_gamma]`` of ``rms_forward_affine``."""
    return _backward(True, dout, None, invvar, input_or_output, normalized_shape, gamma, None, memory_efficient)
