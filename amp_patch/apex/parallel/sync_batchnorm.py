"""Stand-in for Apex's ``apex.parallel.SyncBatchNorm`` (its CUDA-extension and
its Python versions alike) and ``convert_syncbn_model``.

In training, the batch statistics are summed over the process group with
``torch.distributed.all_reduce``, so they are synchronised on any backend,
gloo on CPU included (torch's ``nn.SyncBatchNorm`` synchronises only on
accelerators). The all-reduce is differentiable (its backward all-reduces
the gradients reaching the statistics), so autograd gives every process the
gradient of the whole group's loss, as Apex's hand-written backward did.
Without an initialised process group, or in a group of one, the layer is a
plain batch norm (``torch.nn.functional.batch_norm``), as in Apex.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...patching.cast import LOW

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of a sum over processes is the sum of
    every process's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics cover the batches of every process
    in the group (Apex's ``apex.parallel.SyncBatchNorm``).

    Statistics are computed in FP32 for FP16 and BF16 inputs, and the output
    has the input's dtype, as Apex's CUDA version (and cuDNN) did. In eval
    mode with running statistics it is ``torch.nn.functional.batch_norm``.

    Args:
        num_features: the number of channels C of an input (N, C, ...).
        eps: added to the variance for numerical stability.
        momentum: weight of the batch statistics in the running ones; None
            for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics for eval mode; without
            them eval mode normalises with (synchronised) batch statistics.
        process_group: the group to synchronise over; None for the default group.
        channel_last: the channels are the input's last dimension (N, ..., C).
        fuse_relu: apply a ReLU to the output (after adding ``z``, if given).

    Example::

        torch.distributed.init_process_group("gloo")
        bn = SyncBatchNorm(64)
        out = bn(torch.randn(8, 64, 14, 14))   # normalised over all processes' batches
        out = bn(x, z=residual)                # with fuse_relu=True: relu(bn(x) + residual)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Optional[dist.ProcessGroup] = None, channel_last: bool = False,
                 fuse_relu: bool = False):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def _group_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: Tensor, z: Optional[Tensor] = None) -> Tensor:
        self._check_input_dim(input)
        x = input.movedim(-1, 1) if self.channel_last else input
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or self.running_mean is None
        # in training without tracking, buffers that happen to exist stay untouched
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if batch_stats and self._group_size() > 1:
            out = self._synchronised(x, running_mean, running_var, factor)
        else:
            out = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        if self.channel_last:
            out = out.movedim(1, -1)
        if z is not None:
            out = out + z
        return F.relu(out) if self.fuse_relu else out

    def _synchronised(self, x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                      factor: float) -> Tensor:
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        xf = x.float() if x.dtype in LOW else x
        local_count = xf.new_full((1,), xf.numel() // channels)
        # One all-reduce for the sums and the element count (ranks' batches may differ in size),
        # then one for the squared deviations: two passes, which keep the variance accurate.
        sums = _AllReduceSum.apply(torch.cat([xf.sum(dims), local_count]), self.process_group)
        count = sums[channels]
        mean = sums[:channels] / count
        centered = xf - mean.view(shape)
        var = _AllReduceSum.apply(centered.square().sum(dims), self.process_group) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), factor)
                # running variance is unbiased, as torch's and Apex's
                running_var.lerp_((var * (count / (count - 1))).to(running_var.dtype), factor)
        return out.to(x.dtype)


def convert_syncbn_model(module: nn.Module, process_group: Optional[dist.ProcessGroup] = None, channel_last: bool = False) -> nn.Module:
    """Replace every batch norm in ``module`` with a :class:`SyncBatchNorm`
    (Apex's ``apex.parallel.convert_syncbn_model``).

    Each replacement takes over the batch norm's parameters and buffers (the
    same tensors, so an optimizer built before the conversion still updates
    them) and its train/eval mode. Instance norms are left alone. Children
    are replaced in place; the converted root is returned.

    Args:
        module: the model (or a single batch norm).
        process_group: the group the statistics are synchronised over; None
            for the default group.
        channel_last: the converted layers take channel-last inputs.

    Example::

        model = convert_syncbn_model(torchvision.models.resnet50())
        model = DistributedDataParallel(model)
    """
    converted = module
    if isinstance(module, _BatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, channel_last=channel_last)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size: int) -> Optional[dist.ProcessGroup]:
    """Split the processes into consecutive groups of ``group_size`` and return
    this process's group, to synchronise batch norms within it only (Apex's
    helper of the same name). Every process must call it, since each takes part
    in creating every group.

    Args:
        group_size: processes per group; it must divide the world size. 0
            means the whole world, for which None (the default group) is returned.

    Example::

        group = create_syncbn_process_group(8)          # one group per 8-GPU node
        model = convert_syncbn_model(model, process_group=group)
    """
    if group_size == 0:
        return None
    world = dist.get_world_size()
    if group_size < 0 or world % group_size:
        raise ValueError(f"create_syncbn_process_group: group_size {group_size} does not divide the world size {world}")
    groups = [dist.new_group(list(range(start, start + group_size))) for start in range(0, world, group_size)]
    return groups[dist.get_rank() // group_size]
