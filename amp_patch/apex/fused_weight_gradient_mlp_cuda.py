"""Stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` extension, which
Megatron calls for gradient-accumulation fusion: the weight gradient of a
linear layer added straight into an FP32 (or half) ``main_grad`` buffer.

``wgrad_gemm_accum_fp32(input_2d, d_output_2d, d_weight)``:
``d_weight += d_output_2d.T @ input_2d``, accumulated in FP32 into the FP32
``d_weight``; ``wgrad_gemm_accum_fp16`` does the same into a half ``d_weight``.
"""
from __future__ import annotations

import torch

__all__ = ["wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]


def _accumulate(input_2d: torch.Tensor, d_output_2d: torch.Tensor, d_weight: torch.Tensor) -> None:
    if input_2d.dim() != 2 or d_output_2d.dim() != 2 or input_2d.size(0) != d_output_2d.size(0):
        raise RuntimeError(f"wgrad_gemm_accum: input_2d {tuple(input_2d.shape)} and d_output_2d "
                           f"{tuple(d_output_2d.shape)} must be 2-d with as many rows")
    if tuple(d_weight.shape) != (d_output_2d.size(1), input_2d.size(1)):
        raise RuntimeError(f"wgrad_gemm_accum: d_weight {tuple(d_weight.shape)} must be "
                           f"{(d_output_2d.size(1), input_2d.size(1))} (out_dim x in_dim)")
    grad = d_output_2d.t().to(torch.float32) @ input_2d.to(torch.float32)
    d_weight.copy_(d_weight.to(torch.float32) + grad)


def wgrad_gemm_accum_fp32(input_2d: torch.Tensor, d_output_2d: torch.Tensor, d_weight: torch.Tensor) -> None:
    """``d_weight += d_output_2d.T @ input_2d`` into an FP32 ``d_weight``, in place.

    Example::

        import fused_weight_gradient_mlp_cuda
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x2d, dy2d, weight.main_grad)
    """
    if d_weight.dtype != torch.float32:
        raise RuntimeError(f"wgrad_gemm_accum_fp32: d_weight must be FP32, not {d_weight.dtype}")
    _accumulate(input_2d, d_output_2d, d_weight)


def wgrad_gemm_accum_fp16(input_2d: torch.Tensor, d_output_2d: torch.Tensor, d_weight: torch.Tensor) -> None:
    """``d_weight += d_output_2d.T @ input_2d`` into a half ``d_weight`` (computed in FP32, rounded once)."""
    _accumulate(input_2d, d_output_2d, d_weight)
