"""The optimizer side of a half-precision model: the checks an optimizer must
pass, its FP32 master weights (and their fused update), and the guard that
refuses an optimizer ``initialize`` never saw over half weights."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..base.errors import ConfigError, StateError
from ..config import AmpConfig
from ..patching.cast import LOW
from . import compiled, fsdp, lowstate, master, onepass

if TYPE_CHECKING:
    from .conversions import Conversions


def inner_optimizer(obj: object) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer ``obj`` is, or wraps as ``.optim`` (Apex's ``LARC``,
    which ``amp.initialize`` accepted), or None."""
    if isinstance(obj, torch.optim.Optimizer):
        return obj
    inner = getattr(obj, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def validate(models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], config: AmpConfig,
             joins: Optional["Conversions"], replacing: Optional["Conversions"] = None) -> None:
    """Check ``optimizers`` (with the ``models`` they come with) before anything
    changes; ``joins`` is the state of the session they would join, or None for
    a new one; ``replacing`` that of a provisional session (the launcher's) this
    call ends once every check has passed: its FP32 masters count as the model
    parameters they stand in for, since ending it gives those back to the optimizers.

    Raises:
        ConfigError: naming the optimizer and the fix.
    """
    compiled.validate(config, list(optimizers))
    lowstate.validate(optimizers, config)
    for i, opt in enumerate(optimizers):
        if joins is not None and joins.attached(opt):
            raise ConfigError(f"optimizer {i} ({type(opt).__name__}) is already attached; pass each optimizer to initialize once")
    if config.master_weights and config.cast_model_type is None and not any(
        p.dtype in LOW for m in list(models) + (list(joins.models) if joins else []) for p in m.parameters()
    ):
        raise ConfigError(
            "master_weights=True with cast_model_type=False needs a model that already holds FP16/BF16 "
            "parameters; these models are all FP32, so FP32 master weights would copy them for nothing. "
            "Let the opt level cast the model (drop cast_model_type=False), or drop master_weights."
        )
    if config.master_weights:
        every = list(models) + (list(joins.models) if joins else [])
        # a sharded model's own parameters may be the gathered ones just now (after a forward): its
        # sharded DTensors are what an optimizer holds
        known = {id(p) for m in every for p in m.parameters()} | fsdp.sharded_ids(every)
        if replacing is not None:
            for mw in replacing.masters():
                known.update(id(m) for half, m in zip(mw.halfs, mw.masters) if id(half) in known)
        owner: Dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    where = f"optimizer {i} ({type(opt).__name__}) param_groups[{g}]['params'][{j}] (shape {list(p.shape)})"
                    if id(p) not in known:
                        raise ConfigError(
                            f"{where} is not a parameter of the model(s) passed to initialize. Under "
                            f"opt_level={config.opt_level!r} each model parameter in the optimizer is replaced by an "
                            f"FP32 master, so pass every model whose parameters the optimizer holds (or build the "
                            f"optimizer from model.parameters())." + fsdp.stale_hint(every)
                        )
                    if id(p) in owner and owner[id(p)] != i:
                        raise ConfigError(
                            f"{where} is also held by optimizer {owner[id(p)]}; with FP32 master weights each "
                            f"parameter can belong to one optimizer only"
                        )
                    owner[id(p)] = i
            fsdp.check_optimizer(i, opt, every)
    elif config.cast_model_type is None and not config.allow_half_params:
        # what the provisional session converted goes back to FP32 when it ends
        converted = set(replacing.dtypes_before()) if replacing is not None else set()
        for i, opt in enumerate(optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    if p.dtype in LOW and id(p) not in converted:
                        raise ConfigError(
                            f"optimizer {i} ({type(opt).__name__}) param_groups[{g}]['params'][{j}] is {p.dtype}: "
                            f"the optimizer would update half-precision weights directly (FP16 master weights), "
                            f"and small updates would round away. Pass the FP32 model (do not call .half() before "
                            f"initialize), or use opt_level='O2' for FP32 master weights."
                        )


class _StrayStepGuard:
    """Refuses the step of an optimizer that ``initialize`` never saw, over the
    half parameters of a model it converted (O2/O5), naming the fix.

    Such an optimizer (built after ``initialize(model)``, or a second one over
    the same model) would update the half weights directly, with no FP32
    masters and no loss scaling. A global optimizer step pre-hook, removed
    when called as the undo callback; an attached optimizer returns at once.
    """

    amp_patch_internal = True  # not a user's hook: the one-pass step may run past it (onepass.refused)

    def __init__(self, conv: "Conversions"):
        self.conv = conv
        self.seen: Tuple[int, frozenset] = (-1, frozenset())
        self.handle = register_optimizer_step_pre_hook(self.check)

    def _halves(self) -> frozenset:
        models = self.conv.models
        if self.seen[0] != len(models):  # a later initialize may have added models
            ids = frozenset(id(p) for m in models for p in m.parameters() if p.dtype in LOW)
            self.seen = (len(models), ids)
        return self.seen[1]

    def check(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.conv.known(optimizer) or not self.conv.live():
            return
        halves = self._halves()
        if any(id(p) in halves for g in optimizer.param_groups for p in g["params"]):
            level = self.conv.config.opt_level
            raise StateError(
                f"{type(optimizer).__name__}.step() would update half-precision weights of a model "
                f"amp_patch converted at {level}, but this optimizer was not given to initialize, so it "
                f"has no FP32 master weights and no loss scaling. Pass it to initialize "
                f"(model, optimizer = amp_patch.initialize(model, optimizer, opt_level={level!r})), or "
                f"attach it where it is created: optimizer = amp_patch.adopt_optimizer(optimizer)."
            )

    def __call__(self) -> None:
        self.handle.remove()


class _Release:
    """Undo callback: an optimizer's masters back to the model's parameters."""

    def __init__(self, masters: master.MasterWeights):
        self.masters = masters

    def __call__(self) -> None:
        self.masters.restore()


#: what ``attach`` built for one optimizer: its masters (O2/O5), their compiled fused
#: update (``fused_update=True``) and its one-pass step (where the C kernel is built), if any
Built = Tuple[Optional[master.MasterWeights], Optional[compiled.CompiledUpdate], Optional[onepass.OnePassStep]]


def attach(conv: "Conversions", models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
           originals: Dict[int, tuple], config: AmpConfig) -> Dict[int, Built]:
    """Put FP32 masters into ``optimizers`` (O2/O5), built on ``originals``
    (``model.attach``), and guard the converted ``models`` against optimizers
    nobody attached. Returns ``{id(optimizer): (masters, fused update, one-pass step)}``;
    at O1/O4 only the one-pass step of the FP32 parameters themselves. At O7
    each optimizer's moments are then kept in FP8/BF16 (``lowstate``).

    Each change pushes its undo onto ``conv.undo`` as it is made.
    """
    undo = conv.undo
    if config.master_weights and models and not any(isinstance(cb, _StrayStepGuard) for cb in undo):
        undo.push(_StrayStepGuard(conv))
    built: Dict[int, Built] = {}
    if not config.master_weights:
        if config.patch_torch_functions and onepass.native is not None:
            # O1/O4: no masters, but the step of the model's own FP32 parameters
            # is still one call where the kernel is exact (onepass.OnePassStep)
            for opt in optimizers:
                built[id(opt)] = (None, None, onepass.OnePassStep(opt))
        lowstate.attach(undo, optimizers, config)
        return built
    every = list(models) + list(conv.models)  # adopt_optimizer passes no models: the session's
    shards = fsdp.sharded_ids(every) if any(fsdp.sharded(m) for m in every) else set()
    for opt in optimizers:
        if shards and any(id(p) in shards for g in opt.param_groups for p in g["params"]):
            # a fully_shard-ed model's FP32 shards are the masters (fsdp): the optimizer keeps
            # them, and the one-pass step runs on each rank's local shards
            built[id(opt)] = (None, None, onepass.OnePassStep(opt) if onepass.native is not None else None)
            continue
        mw = master.MasterWeights(opt, model_grads=config.model_grads, watch_writes=True)
        undo.push(_Release(mw))
        for group in opt.param_groups:
            mw.adopt(group, originals)
        built[id(opt)] = (mw, compiled.CompiledUpdate(mw) if config.fused_update else None,
                          onepass.OnePassStep(opt, mw) if onepass.native is not None else None)
    lowstate.attach(undo, optimizers, config)  # after the masters: its undo runs first
    return built
