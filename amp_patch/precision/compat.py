"""Checks against torch wrappers that own a model's parameters, run before
``initialize`` changes anything.

FSDP (``torch.distributed.fsdp.fully_shard`` and the older
``FullyShardedDataParallel``) shards a model's parameters, replaces them with
DTensors or flat parameters, and all-gathers them in the dtype its own
mixed-precision policy names. O1/O4 leave the parameters alone (they patch
functions) and work with both. O2/O5 on a ``fully_shard`` (FSDP2) model set
FSDP's policies instead of casting the model (``fsdp``, which checks what it
cannot do); O3, and any half level on ``FullyShardedDataParallel``, would fight
FSDP over the same tensors, so they refuse the model and say what to use.
"""
from __future__ import annotations

import sys
from typing import List, Sequence, Tuple

from torch import nn

from ..base.errors import ConfigError
from ..config import AmpConfig
from ..patching.cast import LOW
from . import fsdp


def fsdp_wrapped(model: nn.Module) -> List[Tuple[str, str]]:
    """``(dotted name, "fully_shard" | "FullyShardedDataParallel")`` for each
    FSDP-managed module in ``model`` (the root is named ``"<model>"``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []  # never imported: nothing can be wrapped by it
    kinds = [(getattr(fsdp, "FSDPModule", None), "fully_shard"),
             (getattr(fsdp, "FullyShardedDataParallel", None), "FullyShardedDataParallel")]
    kinds = [(cls, name) for cls, name in kinds if isinstance(cls, type)]
    found = []
    for name, m in model.named_modules():
        for cls, kind in kinds:
            if isinstance(m, cls):
                found.append((name or "<model>", kind))
                break
    return found


def check_models(models: Sequence[nn.Module], config: AmpConfig) -> None:
    """Refuse to cast an FSDP model to half precision, except FSDP2 under
    O2/O5 (``fsdp.check`` says what it refuses there).

    Raises:
        ConfigError: naming the model, the wrapped module and what to use.
    """
    if config.cast_model_type not in LOW and not config.master_weights:
        return
    half = str(config.cast_model_type).replace("torch.", "")
    for i, m in enumerate(models):
        found = fsdp_wrapped(m)
        if not found:
            continue
        if all(kind == "fully_shard" for _, kind in found):
            fsdp.check_model(i, m, config)
            continue
        where, kind = next(f for f in found if f[1] != "fully_shard")
        native = (
            "FullyShardedDataParallel(module, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32))"
        )
        raise ConfigError(
            f"model {i} ({type(m).__name__}) is sharded by FSDP ({kind} on {where}), which owns its "
            f"parameters and their dtype; opt_level={config.opt_level!r} would cast them to {half} and keep "
            f"FP32 masters beside FSDP's flat parameters. Use opt_level='O1' (or 'O4' for BF16), which leaves the "
            f"parameters alone; or shard with FSDP2's fully_shard instead, on which O2/O5 run with FSDP's FP32 "
            f"shards as the masters; or let FSDP keep the FP32 weights and compute in half itself: {native}."
        )
