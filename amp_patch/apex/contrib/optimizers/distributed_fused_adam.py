"""``apex.contrib.optimizers.distributed_fused_adam``: ``DistributedFusedAdam``.

Apex's version is Adam with ZeRO: it shards the optimizer state across the
data-parallel processes and synchronises the gradients itself (scripts use it
without DDP). Here the update is ``apex.optimizers.FusedAdam``'s and the
gradient synchronisation is one all-reduce of each gradient over
``distributed_process_group`` (averaged with ``average_grad_sync``), done
once per step; the state is not sharded, so each process holds all of it.
Without an initialised process group (one process) it is ``FusedAdam``. The
results are the same as Apex's; the memory saving is not.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...optimizers import FusedAdam
from ...optimizers.common import Closure, Params

log = logging.getLogger("amp_patch")

__all__ = ["DistributedFusedAdam"]


@contextlib.contextmanager
def _disable_pre_forward_hook(param: torch.nn.Parameter) -> Iterator[None]:
    """Apex's helper that stops a parameter's pre-forward hook (its all-gather)
    inside the block; the parameters here are never sharded, so it only keeps
    Apex's ``_pre_forward_hook_is_enabled`` flag as Apex did."""
    enabled = getattr(param, "_pre_forward_hook_is_enabled", False)
    if enabled:
        param._pre_forward_hook_is_enabled = False
    try:
        yield
    finally:
        if enabled:
            param._pre_forward_hook_is_enabled = True


#: Apex's import of torch's coalescing context manager, which subclasses of the optimizer use
_coalescing_manager = dist.distributed_c10d._coalescing_manager

#: Apex's tuning and memory-layout keywords: accepted, and without effect here
_LAYOUT = ("dtype", "grad_sync_dtype", "param_sync_dtype", "device", "redundant_process_group", "overlap_grad_sync",
           "overlap_param_sync", "bucket_cap_mb", "pipeline_size", "contiguous_param_buffer",
           "contiguous_grad_buffer", "store_params", "store_param_remainders", "with_scaled_states", "nccl_ub")


class DistributedFusedAdam(FusedAdam):
    """Apex's ``DistributedFusedAdam``: Adam (AdamW by default) whose gradients are
    all-reduced across the data-parallel processes at each ``step``.

    Args:
        params: parameters or param-group dicts.
        lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad: as ``FusedAdam``.
        process_group: the group of all processes (Apex's default: the world).
        distributed_process_group: the data-parallel group the gradients are
            reduced over (default: ``process_group``).
        average_grad_sync: divide the summed gradients by the group's size.
        capturable: refused (Apex's CUDA-graph form).
        **layout: Apex's other keywords (``dtype``, ``bucket_cap_mb``,
            ``overlap_grad_sync``, ``store_params``, ...), accepted and ignored.

    Example::

        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
        opt = DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01)
        loss.backward()            # no DDP wrapper: the optimizer reduces the gradients
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, process_group: Optional[dist.ProcessGroup] = None,
                 distributed_process_group: Optional[dist.ProcessGroup] = None, average_grad_sync: bool = True, capturable: bool = False,
                 **layout: object):
        unknown = sorted(set(layout) - set(_LAYOUT))
        if unknown:
            raise TypeError(f"DistributedFusedAdam got unexpected keyword argument(s) {unknown}; "
                            f"Apex's keywords are {', '.join(_LAYOUT)} and those of FusedAdam")
        if capturable:
            raise ValueError("DistributedFusedAdam(capturable=True) is Apex's CUDA-graph form, which is not served; "
                             "use apex.optimizers.FusedAdam(capturable=True) or torch.optim.AdamW(fused=True)")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad, set_grad_none=False)
        self.process_group = process_group
        self.distributed_process_group = process_group if distributed_process_group is None else distributed_process_group
        self.average_grad_sync = average_grad_sync
        self.layout = dict(layout)
        self._synced = False

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """Every parameter the optimizer holds."""
        return (p for group in self.param_groups for p in group["params"])

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def grad_sync(self) -> None:
        """All-reduce the gradients over the data-parallel group (once per step)."""
        if self._synced:
            return
        self._synced = True
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = self.distributed_process_group
        world = dist.get_world_size(group)
        if world == 1:
            return
        for g in self._grads():
            dist.all_reduce(g, group=group)
            if self.average_grad_sync:
                g.div_(world)

    def param_sync(self) -> None:
        """Nothing to do: every process holds all the parameters, updated alike."""

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False) -> Iterator[None]:
        """Gradient accumulation: the gradients are reduced at ``step`` (or
        ``grad_sync``) in any case, so this only marks the block, as Apex's."""
        yield

    def grad_norm(self, parameters: Optional[Iterable[torch.Tensor]] = None, norm_type: float = 2.0,
                  force: bool = False) -> torch.Tensor:
        """The total ``norm_type`` norm of the synchronised gradients (of ``parameters``, default all)."""
        self.grad_sync()
        params = list(self.parameters()) if parameters is None else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def clip_grad_norm(self, max_norm: float, parameters: Optional[Iterable[torch.Tensor]] = None,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Scale the synchronised gradients by ``max_norm / (norm + 1e-6)`` when below 1; returns the norm."""
        params = list(self.parameters()) if parameters is None else list(parameters)
        norm = self.grad_norm(params, norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm

    @torch.no_grad()
    def step(self, closure: Closure = None, *, grad_scaler: Optional[torch.amp.GradScaler] = None) -> Any:
        """Synchronise the gradients, then one ``FusedAdam`` step."""
        if grad_scaler is not None:
            raise ValueError("DistributedFusedAdam.step: pass the optimizer to scaler.step(optimizer), which "
                             "unscales and skips on an overflow before calling step()")
        self.grad_sync()
        try:
            return super().step(closure)
        finally:
            self._synced = False

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear the gradients (to zero by default, as Apex's)."""
        super().zero_grad(set_to_none)
        self._synced = False
