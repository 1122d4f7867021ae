"""Stand-in for ``apex.normalization.fused_layer_norm``: layer norm and RMS
norm on torch's own kernels,
``torch.nn.functional.layer_norm`` and ``torch.nn.functional.rms_norm``.

The modules subclass ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``, whose
parameters, initialisation and arithmetic they share, so ``isinstance``
checks (amp_patch's O2 conversion included) treat them as the norms they are.

Apex's dtype contract, kept on every device:

* ``FusedLayerNorm`` / ``FusedRMSNorm`` and ``fused_*`` return the input's dtype;
* ``MixedFused*`` and ``mixed_dtype_fused_*`` return the weight's dtype
  (FP32 weights with a half input give an FP32 output);
* statistics and the affine step are computed in FP32 for half inputs,
  rounded once into the output dtype;
* under autocast the input and parameters are first cast to the autocast
  dtype, so the output is in that dtype too.

``memory_efficient`` is accepted and kept; torch's kernels decide what the
backward saves.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

Tensor = torch.Tensor
f32 = torch.float32
Shape = Union[int, Sequence[int], torch.Size]

__all__ = [
    "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
    "fused_layer_norm", "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine",
    "fused_rms_norm", "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine",
    "FusedLayerNormAffineFunction", "FusedLayerNormFunction", "FusedRMSNormAffineFunction", "FusedRMSNormFunction",
    "FusedLayerNormAffineMixedDtypesFunction", "FusedRMSNormAffineMixedDtypesFunction",
]


def _shape(normalized_shape: Shape) -> Tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


def _compute(kind: str, x: Tensor, shape: Tuple[int, ...], w: Optional[Tensor], b: Optional[Tensor], eps: float,
             mixed: bool) -> Tensor:
    out = w.dtype if mixed and w is not None else x.dtype
    if any(t is not None and t.dtype != x.dtype for t in (w, b)):
        # torch's kernels take one dtype: mixed operands are computed in FP32,
        # as Apex's kernel does, and rounded once below
        x, w, b = (None if t is None else t.to(f32) for t in (x, w, b))
    y = F.layer_norm(x, shape, w, b, eps) if kind == "layer" else F.rms_norm(x, shape, w, eps)
    return y.to(out)


def _norm(kind: str, input: Tensor, normalized_shape: Shape, weight: Optional[Tensor], bias: Optional[Tensor],
          eps: float, mixed: bool) -> Tensor:
    """Layer norm (``kind="layer"``) or RMS norm of ``input``, in Apex's output dtype."""
    shape = _shape(normalized_shape)
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return _compute(kind, input, shape, weight, bias, eps, mixed)
    # Apex's rule: everything in the autocast dtype, then the kernel with
    # autocast off (which would otherwise run a norm in FP32)
    dtype = torch.get_autocast_dtype(device)
    x, w, b = (None if t is None else t.to(dtype) for t in (input, weight, bias))
    with torch.autocast(device, enabled=False):
        return _compute(kind, x, shape, w, b, eps, mixed)


def fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: Shape,
                            eps: float = 1e-6, memory_efficient: bool = False) -> Tensor:
    """Layer norm with an affine step, returned in ``input``'s dtype.

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        weight: the scale, of ``normalized_shape``.
        bias: the shift, of ``normalized_shape``.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the variance.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = fused_layer_norm_affine(x, ln.weight, ln.bias, (512,), 1e-5)
    """
    return _norm("layer", input, normalized_shape, weight, bias, eps, mixed=False)


def fused_layer_norm(input: Tensor, normalized_shape: Shape, eps: float = 1e-6,
                     memory_efficient: bool = False) -> Tensor:
    """Layer norm without an affine step, returned in ``input``'s dtype.

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the variance.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = fused_layer_norm(x, (512,))
    """
    return _norm("layer", input, normalized_shape, None, None, eps, mixed=False)


def mixed_dtype_fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: Shape,
                                        eps: float = 1e-6, memory_efficient: bool = False) -> Tensor:
    """Layer norm with an affine step, returned in ``weight``'s dtype (a half
    input with FP32 parameters gives FP32).

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        weight: the scale, of ``normalized_shape``; its dtype is the output's.
        bias: the shift, of ``normalized_shape``.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the variance.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = mixed_dtype_fused_layer_norm_affine(x.half(), w32, b32, (512,))   # y is FP32
    """
    return _norm("layer", input, normalized_shape, weight, bias, eps, mixed=True)


def fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: Shape, eps: float = 1e-6,
                          memory_efficient: bool = False) -> Tensor:
    """RMS norm with a scale, returned in ``input``'s dtype.

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        weight: the scale, of ``normalized_shape``.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the mean square.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = fused_rms_norm_affine(x, norm.weight, (512,), 1e-5)
    """
    return _norm("rms", input, normalized_shape, weight, None, eps, mixed=False)


def fused_rms_norm(input: Tensor, normalized_shape: Shape, eps: float = 1e-6,
                   memory_efficient: bool = False) -> Tensor:
    """RMS norm without a scale, returned in ``input``'s dtype.

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the mean square.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = fused_rms_norm(x, (512,))
    """
    return _norm("rms", input, normalized_shape, None, None, eps, mixed=False)


def mixed_dtype_fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape: Shape, eps: float = 1e-6,
                                      memory_efficient: bool = False) -> Tensor:
    """RMS norm with a scale, returned in ``weight``'s dtype (a half input
    with an FP32 weight gives FP32).

    Args:
        input: the tensor to normalise over its last ``len(normalized_shape)`` dimensions.
        weight: the scale, of ``normalized_shape``; its dtype is the output's.
        normalized_shape: the trailing shape to normalise over.
        eps: added to the mean square.
        memory_efficient: accepted for Apex's signature.

    Example::

        y = mixed_dtype_fused_rms_norm_affine(x.bfloat16(), w32, (512,))   # y is FP32
    """
    return _norm("rms", input, normalized_shape, weight, None, eps, mixed=True)


def _vjp(ctx: Any, fn: Callable[..., Tensor], grad: Tensor) -> Tuple[Optional[Tensor], ...]:
    """The gradients of ``fn(*ctx.saved_tensors)``, re-run under autograd:
    one per saved tensor, None where none is needed."""
    with torch.enable_grad():
        xs = [None if t is None else t.detach().requires_grad_(need)
              for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        wanted = [x for x in xs if x is not None and x.requires_grad]
        grads = iter(torch.autograd.grad(fn(*xs), wanted, grad) if wanted else ())
    return tuple(next(grads) if x is not None and x.requires_grad else None for x in xs)


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """Apex's autograd function of ``fused_layer_norm_affine``, which scripts
    (Megatron's) call as ``FusedLayerNormAffineFunction.apply(input, weight,
    bias, normalized_shape, eps)``; the output is in ``input``'s dtype.

    Example::

        from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
        y = FusedLayerNormAffineFunction.apply(x, ln.weight, ln.bias, (512,), 1e-5)
    """

    _mixed = False

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps, ctx.mixed = normalized_shape, eps, FusedLayerNormAffineFunction._mixed
        ctx.save_for_backward(input, weight, bias)
        return _norm("layer", input, normalized_shape, weight, bias, eps, mixed=ctx.mixed)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        fn = lambda x, w, b: _norm("layer", x, ctx.shape, w, b, ctx.eps, mixed=ctx.mixed)  # noqa: E731
        return _vjp(ctx, fn, grad) + (None, None, None)


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """``FusedLayerNormAffineFunction`` with the output in ``weight``'s dtype
    (``mixed_dtype_fused_layer_norm_affine``'s function)."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps, ctx.mixed = normalized_shape, eps, True
        ctx.save_for_backward(input, weight, bias)
        return _norm("layer", input, normalized_shape, weight, bias, eps, mixed=True)


class FusedLayerNormFunction(torch.autograd.Function):
    """Apex's autograd function of ``fused_layer_norm`` (no affine step):
    ``FusedLayerNormFunction.apply(input, normalized_shape, eps)``.

    Example::

        y = FusedLayerNormFunction.apply(x, (512,), 1e-5)
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps = normalized_shape, eps
        ctx.save_for_backward(input)
        return _norm("layer", input, normalized_shape, None, None, eps, mixed=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        fn = lambda x: _norm("layer", x, ctx.shape, None, None, ctx.eps, mixed=False)  # noqa: E731
        return _vjp(ctx, fn, grad) + (None, None, None)


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """Apex's autograd function of ``fused_rms_norm_affine``:
    ``FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps)``.

    Example::

        y = FusedRMSNormAffineFunction.apply(x, norm.weight, (512,), 1e-5)
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps, ctx.mixed = normalized_shape, eps, False
        ctx.save_for_backward(input, weight)
        return _norm("rms", input, normalized_shape, weight, None, eps, mixed=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        fn = lambda x, w: _norm("rms", x, ctx.shape, w, None, ctx.eps, mixed=ctx.mixed)  # noqa: E731
        return _vjp(ctx, fn, grad) + (None, None, None)


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """``FusedRMSNormAffineFunction`` with the output in ``weight``'s dtype."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps, ctx.mixed = normalized_shape, eps, True
        ctx.save_for_backward(input, weight)
        return _norm("rms", input, normalized_shape, weight, None, eps, mixed=True)


class FusedRMSNormFunction(torch.autograd.Function):
    """Apex's autograd function of ``fused_rms_norm`` (no scale):
    ``FusedRMSNormFunction.apply(input, normalized_shape, eps)``.

    Example::

        y = FusedRMSNormFunction.apply(x, (512,), 1e-5)
    """

    @staticmethod
    def forward(ctx: Any, input: Tensor, normalized_shape: Shape, eps: float,
                memory_efficient: bool = False) -> Tensor:
        ctx.shape, ctx.eps = normalized_shape, eps
        ctx.save_for_backward(input)
        return _norm("rms", input, normalized_shape, None, None, eps, mixed=False)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        fn = lambda x: _norm("rms", x, ctx.shape, None, None, ctx.eps, mixed=False)  # noqa: E731
        return _vjp(ctx, fn, grad) + (None, None, None)


class _Apex:
    """What Apex's norm modules add to torch's: ``memory_efficient``, kept,
    and a forward in Apex's output dtype (the weight's when ``_mixed``, else
    the input's)."""

    _kind: str
    _mixed = False

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False):
        super().__init__(_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient

    def forward(self, input: Tensor) -> Tensor:
        bias = getattr(self, "bias", None)  # nn.RMSNorm has none
        return _norm(self._kind, input, self.normalized_shape, self.weight, bias, self.eps, self._mixed)


class _Mixed:
    """Apex's Mixed norms: always affine, their output in the weight's dtype."""

    _mixed = True

    def __init__(self, normalized_shape: Shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs: object):
        if "elementwise_affine" in kwargs:  # Apex's check on the argument it always overrides
            warnings.warn(f"{type(self).__name__} does not support `elementwise_affine` argument", stacklevel=2)
            if not kwargs.pop("elementwise_affine"):
                raise RuntimeError(f"{type(self).__name__} does not support `elementwise_affine = False`")
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, memory_efficient=memory_efficient)


class FusedLayerNorm(_Apex, nn.LayerNorm):
    """Apex's ``FusedLayerNorm``: an ``nn.LayerNorm`` whose output keeps the input's dtype.

    Args:
        normalized_shape: the trailing shape to normalise over (an int for the last dimension).
        eps: added to the variance.
        elementwise_affine: learn a weight (ones) and a bias (zeros) of ``normalized_shape``.
        memory_efficient: accepted and kept, for Apex's signature.

    Example::

        from apex.normalization import FusedLayerNorm
        ln = FusedLayerNorm(512)
        y = ln(torch.randn(8, 16, 512))
    """

    _kind = "layer"


class FusedRMSNorm(_Apex, nn.RMSNorm):
    """Apex's ``FusedRMSNorm``: an ``nn.RMSNorm`` whose output keeps the input's dtype.

    ``y = x / sqrt(mean(x**2) + eps) * weight`` over ``normalized_shape``.

    Args:
        normalized_shape: the trailing shape to normalise over (an int for the last dimension).
        eps: added to the mean square (Apex's default, 1e-5; not ``nn.RMSNorm``'s dtype epsilon).
        elementwise_affine: learn a weight (ones) of ``normalized_shape``.
        memory_efficient: accepted and kept, for Apex's signature.

    Example::

        from apex.normalization import FusedRMSNorm
        norm = FusedRMSNorm(512)
        y = norm(torch.randn(8, 16, 512))
    """

    _kind = "rms"


class MixedFusedLayerNorm(_Mixed, FusedLayerNorm):
    """Apex's ``MixedFusedLayerNorm``: always affine, its output in the weight's
    dtype (FP32 weights with a half input give FP32), as Megatron expects.

    Args:
        normalized_shape: the trailing shape to normalise over.
        eps: added to the variance.
        memory_efficient: accepted and kept, for Apex's signature.
        **kwargs: ``elementwise_affine=True`` is accepted with a warning and
            ``False`` refused, as Apex does; other keywords are ignored, as Apex does.

    Example::

        from apex.normalization import MixedFusedLayerNorm
        ln = MixedFusedLayerNorm(512)              # FP32 weight and bias
        y = ln(torch.randn(4, 512).bfloat16())     # y is FP32
    """


class MixedFusedRMSNorm(_Mixed, FusedRMSNorm):
    """Apex's ``MixedFusedRMSNorm``: always affine, its output in the weight's dtype.

    Args:
        normalized_shape: the trailing shape to normalise over.
        eps: added to the mean square.
        memory_efficient: accepted and kept, for Apex's signature.
        **kwargs: ``elementwise_affine=True`` is accepted with a warning and
            ``False`` refused, as Apex does; other keywords are ignored, as Apex does.

    Example::

        from apex.normalization import MixedFusedRMSNorm
        norm = MixedFusedRMSNorm(512)
        y = norm(torch.randn(4, 512).half())       # y is FP32
    """
