"""Stand-in for Apex's ``apex.parallel.distributed``: ``DistributedDataParallel``,
``Reducer`` and ``flat_dist_call``.

Apex's DDP bucketed and all-reduced gradients on its own CUDA streams. Here
``torch.nn.parallel.DistributedDataParallel`` does the bucketing and the
overlap (on any backend, gloo on CPU included), and a DDP communication hook
carries out the Apex options that change the numbers: averaging or summing,
the pre-division factor, and all-reducing half gradients in FP32.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ...diagnostics.notices import warn_user
from ...patching.cast import LOW

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

#: Apex's arguments that only steered its own bucketing, streams and profiling,
#: with their defaults; torch's DDP makes those choices itself.
IGNORED = dict(
    message_size=10000000,
    delay_allreduce=False,
    allreduce_trigger_params=None,
    retain_allreduce_buffers=False,
    num_allreduce_streams=1,
    allreduce_communicators=None,
    gradient_average_split_factor=None,
    prof=False,
)

# Apex never re-broadcast buffers in forward; torch names that switch
# forward_sync_buffers since it deprecated broadcast_buffers.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters
                   else {"broadcast_buffers": False})


def flat_dist_call(tensors: Sequence[torch.Tensor], call: Callable[..., Any],
                   extra_args: Optional[tuple] = None) -> None:
    """Run one collective ``call`` per dtype and device over ``tensors``, flattened,
    and copy the results back in place (Apex's helper of the same name).

    As in Apex, a ``dist.all_reduce`` result is divided by the world size, so
    the tensors end up averaged over the processes.

    Args:
        tensors: the tensors to communicate, written in place.
        call: a ``torch.distributed`` collective taking the flat tensor first.
        extra_args: further positional arguments for ``call`` (``(0,)`` for a
            broadcast from rank 0).

    Example::

        flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))
        flat_dist_call([p.grad for p in model.parameters()], dist.all_reduce)
    """
    buckets: Dict[tuple, List[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = _flatten_dense_tensors(bucket)
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)


def _tensors_in(obj: Any) -> List[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    try:
        items = iter(obj)
    except TypeError:
        return []
    return [t for item in items for t in _tensors_in(item)]


class Reducer:
    """Apex's manual all-reduce: averages gradients over the processes when
    ``reduce()`` is called, never by itself during ``backward()``.

    Args:
        module_or_grads_list: a module (its parameters are broadcast from rank
            0 now, and ``reduce()`` averages the gradients they have then), or
            an iterable of gradient tensors to average in place.

    Example::

        reducer = Reducer(model)
        for step, (x, y) in enumerate(loader):
            loss_fn(model(x), y).backward()
            if step % 4 == 3:          # all-reduce every fourth step only
                reducer.reduce()
                optimizer.step()
                optimizer.zero_grad()
    """

    def __init__(self, module_or_grads_list: Union[nn.Module, Iterable[torch.Tensor]]):
        if isinstance(module_or_grads_list, nn.Module):
            self.module: Optional[nn.Module] = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = _tensors_in(module_or_grads_list)

    def reduce(self) -> None:
        """Average the gradients over the processes, in place."""
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)


@dataclass(frozen=True)
class _Averaging:
    """What the communication hook does around the all-reduce (Apex's arithmetic):
    multiply by ``before``, sum over the group, multiply by ``after``."""
    group: Optional[dist.ProcessGroup]
    before: float
    after: float
    fp32: bool


# No annotations: DDP compares them with its own types, and under postponed
# evaluation they are strings.
def _allreduce_hook(state, bucket):
    buffer = bucket.buffer()
    wide = state.fp32 and buffer.dtype in LOW
    tensor = buffer.float() if wide else buffer
    if state.before != 1.0:
        tensor.mul_(state.before)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.after != 1.0:
            reduced.mul_(state.after)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return dist.all_reduce(tensor, group=state.group, async_op=True).get_future().then(finish)


class DistributedDataParallel(TorchDDP):
    """Apex's ``DistributedDataParallel``, on ``torch.nn.parallel.DistributedDataParallel``.

    It takes Apex's arguments and is a torch DDP (``model.module`` is the
    wrapped module; ``no_sync()`` and torch's other methods work). As in Apex,
    parameters are broadcast from rank 0 once, and buffers are left as each
    process computes them (use ``SyncBatchNorm`` to share batch-norm
    statistics). Arguments that only tuned Apex's own bucketing, streams and
    profiling are accepted, and one ``AmpWarning`` names those given.

    Args:
        module: the model to replicate.
        message_size, delay_allreduce, allreduce_trigger_params,
            retain_allreduce_buffers, num_allreduce_streams,
            allreduce_communicators, gradient_average_split_factor, prof:
            accepted and ignored: torch's DDP buckets gradients (see its
            ``bucket_cap_mb``) and overlaps their all-reduce with backward itself.
        shared_param: refused, as Apex refused it.
        allreduce_always_fp32: all-reduce FP16 and BF16 gradients in FP32.
        gradient_average: False sums the gradients over the processes
            instead of averaging them.
        gradient_predivide_factor: divide the gradients by this before the
            all-reduce and by ``world_size / factor`` after it (only by the
            factor when ``gradient_average`` is False), which keeps FP16 sums
            over many processes in range.
        **ddp_kwargs: passed on to torch's DDP (``device_ids``,
            ``find_unused_parameters``, ``broadcast_buffers``, ``process_group``...).

    Example::

        from apex.parallel import DistributedDataParallel as DDP

        torch.distributed.init_process_group("nccl")
        model = DDP(model.cuda(), gradient_predivide_factor=8.0)
        loss_fn(model(x), y).backward()   # gradients averaged over the processes
        optimizer.step()
    """

    def __init__(self,
                 module: nn.Module,
                 message_size: int = 10000000,
                 delay_allreduce: bool = False,
                 shared_param: object = None,
                 allreduce_trigger_params: Optional[Iterable[torch.Tensor]] = None,
                 retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1,
                 allreduce_communicators: object = None,
                 gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: Optional[float] = None,
                 prof: bool = False,
                 **ddp_kwargs: Any):
        if shared_param is not None:
            raise ValueError(
                "DistributedDataParallel: shared_param is not supported (Apex dropped it too); "
                "shared parameters need no option."
            )
        given = locals()
        ignored = [name for name, default in IGNORED.items() if given[name] != default]
        if ignored:
            warn_user(
                f"apex.parallel.DistributedDataParallel ignores {', '.join(ignored)}: they tuned Apex's own "
                "bucketing, CUDA streams and profiling, and change no gradient. "
                "torch.nn.parallel.DistributedDataParallel underneath buckets the gradients and overlaps "
                "their all-reduce with backward itself (pass bucket_cap_mb=... to size its buckets)."
            )
        if not ddp_kwargs.keys() & {"broadcast_buffers", "forward_sync_buffers"}:
            ddp_kwargs.update(_NO_BUFFER_SYNC)
        super().__init__(module, **ddp_kwargs)
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            world = dist.get_world_size(self.process_group)
            after = gradient_predivide_factor / world if gradient_average else 1.0
            self.register_comm_hook(
                _Averaging(self.process_group, 1.0 / gradient_predivide_factor, after, allreduce_always_fp32),
                _allreduce_hook,
            )

    def disable_allreduce(self) -> None:
        """Keep gradients local in the backwards of the following forwards
        (Apex's switch for what ``no_sync()`` does as a context)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """All-reduce gradients again, from the next forward's backward on."""
        self.require_backward_grad_sync = True
