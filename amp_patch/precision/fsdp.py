"""O2/O5 on a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 already does O2's arithmetic with the masters sharded: each rank keeps
an FP32 shard of every parameter (a ``DTensor``), which the optimizer steps,
and all-gathers the shards in the ``param_dtype`` of the unit's
``MixedPrecisionPolicy`` for the forward and backward; gradients come back
reduce-scattered into the FP32 shards, in the policy's ``reduce_dtype``.
So under O2/O5 amp_patch builds no masters of its own for a sharded model.
It gives FSDP the policies O2 means instead, unit by unit:

* a unit's parameters are gathered in the half dtype, its gradients reduced
  in FP32 (or the ``reduce_dtype`` ``fully_shard`` was given);
* the parameters of the modules O2 keeps in FP32 (batch norms under
  ``keep_batchnorm_fp32``, ``keep_fp32``'s matches) are gathered and reduced
  in FP32. FSDP gathers and reduces one parameter group in one dtype, so
  where such a module shares a ``fully_shard`` unit with half layers (a
  BatchNorm inside a block, a kept head at the root) its parameters move to
  a second parameter group of the same unit (FSDP2 keeps several groups per
  unit for per-parameter meshes), which gathers them in FP32;
* FSDP casts no inputs or outputs: amp_patch's own hooks do, as on an
  unsharded model (the model's inputs to half, its outputs to FP32, a kept
  module's inputs to FP32 and its outputs back), so the sharded model runs
  the ops, in the dtypes, of the same model under O2 in one process.

``apply`` makes these changes and returns their undo (``deinitialize`` gives
every unit the policy and the parameter groups it had). The rest of the
module are the small pieces the scaling and the one-pass step need:
``local`` (a DTensor's local shard), ``unsharded_ids`` (the parameters FSDP
all-gathers for the forward, which are the leaves a backward reaches, not the
sharded ones the optimizer holds).

``fully_shard`` takes a policy only when it is called, and a script shards
before it builds its optimizer and calls ``initialize``; so this module sets
the policy FSDP2 keeps on each parameter group (``FSDPState._fsdp_param_groups``,
``FSDPParamGroup.mp_policy``, from which FSDP derives its dtypes at its lazy
init, or at once through ``_init_mp_dtypes`` where that has run), as torch
2.13 has them. ``check_model`` refuses what cannot work, before anything
changes. FSDP1 (``FullyShardedDataParallel``) keeps its refusal (``compat``).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..base.errors import ConfigError

if TYPE_CHECKING:
    from ..config import AmpConfig

Tensor = torch.Tensor
f32 = torch.float32

#: the settings of an FSDP parameter group a group split from it takes over (the rest is per-group state)
_SETTINGS = (
    "comm_ctx", "_module_fqn", "_reset_sharded_params", "reduce_grads", "all_reduce_grads", "reshard_after_backward",
    "reduce_scatter_max_input_buffers", "gradient_divide_factor", "reduce_scatter_unused_params",
    "force_sum_reduction_for_comms", "unshard_async_op", "unshard_in_backward", "_all_gather_comm",
    "_reduce_scatter_comm", "_all_reduce_hook", "_all_reduce_hook_stream",
)

ORDER = (
    "fully_shard each block and then the root, build the optimizer over the sharded model, then call "
    "amp_patch.initialize(model, optimizer, opt_level=...)"
)


# ------------------------------------------------------------------ finding FSDP2


def _module_class() -> Optional[type]:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return cls if isinstance(cls, type) else None


def dtensor_type() -> Optional[type]:
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (FSDP2's sharded parameters and gradients)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """``t``'s local shard if it is a DTensor (the same memory), else ``t``."""
    cls = dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor
    return t


def states(model: nn.Module) -> List[Any]:
    """The FSDP2 state of every ``fully_shard`` unit in ``model``, once each, in module order."""
    cls = _module_class()
    if cls is None:
        return []
    out, seen = [], set()
    for m in model.modules():
        if isinstance(m, cls):
            st = m._get_fsdp_state()
            if id(st) not in seen:
                seen.add(id(st))
                out.append(st)
    return out


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` itself is a ``fully_shard`` unit (cheap: one look-up and one isinstance)."""
    cls = _module_class()
    return cls is not None and isinstance(module, cls)


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds a ``fully_shard`` unit."""
    cls = _module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def groups(state: Any) -> List[Any]:
    """The parameter groups of one unit (``FSDPParamGroup``)."""
    many = getattr(state, "_fsdp_param_groups", None)
    if many is not None:
        return list(many)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def fsdp_params(models: Iterable[nn.Module]) -> List[Any]:
    """Every ``FSDPParam`` of ``models``' units."""
    return [fp for m in models for st in states(m) for g in groups(st) for fp in g.fsdp_params]


def sharded_ids(models: Iterable[nn.Module]) -> Set[int]:
    """``id`` of every sharded parameter (the DTensors an optimizer holds) of ``models``."""
    return {id(fp.sharded_param) for fp in fsdp_params(models)}


def unsharded_ids(models: Iterable[nn.Module], ids: Set[int]) -> Set[int]:
    """``id`` of the unsharded parameter FSDP gathers for each sharded one in ``ids``:
    the leaf a backward accumulates into (FSDP then reduce-scatters its gradient
    into the sharded parameter's)."""
    out = set()
    for fp in fsdp_params(models):
        if id(fp.sharded_param) in ids:
            u = getattr(fp, "_unsharded_param", None)
            if u is not None:
                out.add(id(u))
    return out


def _modules_of(fp: Any) -> List[nn.Module]:
    info = fp._module_info
    return [info.module] + list(getattr(info, "shared_modules", ()))


# ------------------------------------------------------------------ checks


def check_model(i: int, m: nn.Module, config: "AmpConfig") -> None:
    """Refuse what O2/O5 cannot do on model ``i``, ``m``, ``fully_shard``-ed, before anything changes.

    Raises:
        ConfigError: naming the model, the unit or parameter, and the fix.
    """
    half = config.cast_model_type
    name = str(half).replace("torch.", "")
    if not sharded(m):
        return
    where = f"model {i} ({type(m).__name__})"
    if not config.master_weights or half is None:
        raise ConfigError(
            f"{where} is sharded by fully_shard (FSDP2), whose FP32 sharded parameters are the masters the "
            f"optimizer steps; opt_level={config.opt_level!r} keeps no FP32 weights (O3 steps the half weights "
            f"themselves). Use opt_level='O2' (or 'O5' for BF16), which gives FSDP the policy "
            f"MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) and keeps batch norms in FP32, "
            f"or opt_level='O1' (or 'O4'), which leaves the parameters alone."
        )
    if config.fused_update:
        raise ConfigError(
            f"{where} is sharded by fully_shard: its optimizer steps FSDP's sharded FP32 DTensors, which "
            f"fused_update=True's compiled step of amp_patch's own masters cannot take (the one-pass C step "
            f"runs on each rank's local shards instead). Drop fused_update=True."
        )
    managed = {}
    for fp in fsdp_params([m]):
        managed[id(fp.sharded_param)] = fp
        u = getattr(fp, "_unsharded_param", None)
        if u is not None:
            managed[id(u)] = fp
    loose = [n for n, p in m.named_parameters() if id(p) not in managed]
    if loose:
        raise ConfigError(
            f"{where} is sharded by fully_shard, but {len(loose)} parameter(s) belong to no fully_shard unit "
            f"({', '.join(loose[:3])}{' ...' if len(loose) > 3 else ''}): under opt_level={config.opt_level!r} "
            f"FSDP's FP32 shards are the master weights, and these would have none. Call fully_shard on the "
            f"root too, after its blocks: for block in model.blocks: fully_shard(block); fully_shard(model)."
        )
    for fp in fsdp_params([m]):
        if fp.sharded_param.dtype != f32 and fp.sharded_param.is_floating_point():
            raise ConfigError(
                f"{where}: the sharded parameter {fp._param_fqn or _name_of(m, fp)!r} is "
                f"{fp.sharded_param.dtype}; under opt_level={config.opt_level!r} FSDP's shards are the FP32 "
                f"master weights. Shard the FP32 model (do not call .half() or .to(dtype) before fully_shard)."
            )
    for st in states(m):
        policies = [getattr(st, "_mp_policy", None)] + [getattr(g, "mp_policy", None) for g in groups(st)]
        for pol in policies:
            pd = getattr(pol, "param_dtype", None)
            if pd is not None and pd != half:
                unit = _unit_name(m, st)
                raise ConfigError(
                    f"{where}: fully_shard({unit}, mp_policy=MixedPrecisionPolicy(param_dtype={pd})) asks FSDP "
                    f"to compute in {str(pd).replace('torch.', '')}, but opt_level={config.opt_level!r} computes "
                    f"in {name} and sets FSDP's policy itself. Drop mp_policy= from fully_shard (a reduce_dtype "
                    f"given there is kept), or pass half_dtype={pd} to initialize."
                )
        for g in groups(st):
            if getattr(g, "_training_state", None) is not None and g._training_state.name not in ("IDLE",):
                raise ConfigError(
                    f"{where}: a forward or backward of {_unit_name(m, st)} is in progress; call initialize "
                    f"between steps ({ORDER})."
                )


def check_optimizer(i: int, optimizer: torch.optim.Optimizer, models: Sequence[nn.Module]) -> None:
    """An optimizer over a sharded model holds its sharded parameters, all of them DTensors."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = sharded_ids(models)
    dt = [p for p in params if id(p) in ids]
    if dt and len(dt) != len(params):
        raise ConfigError(
            f"optimizer {i} ({type(optimizer).__name__}) holds {len(dt)} sharded parameter(s) of a fully_shard-ed "
            f"model and {len(params) - len(dt)} other(s). Under O2/O5 FSDP's FP32 shards are the masters of the "
            f"one and amp_patch's FP32 masters those of the others: give each model its own optimizer."
        )


def stale_hint(models: Sequence[nn.Module]) -> str:
    """What to add to "not a parameter of the model" when a model is sharded."""
    if any(sharded(m) for m in models):
        return (" The model is sharded by fully_shard, which replaced its parameters with sharded DTensors: "
                f"build the optimizer after sharding ({ORDER}).")
    return ""


def _unit_name(model: nn.Module, state: Any) -> str:
    mods = getattr(state, "_modules", ())
    for n, m in model.named_modules():
        if any(m is x for x in mods):
            return n or "model"
    return "module"


def _name_of(model: nn.Module, fp: Any) -> str:
    for n, p in model.named_parameters():
        if p is fp.sharded_param:
            return n
    return fp._module_info.param_name


# ------------------------------------------------------------------ the policies


class Policies:
    """The mixed-precision policies O2/O5 gave one sharded model's units, and their undo.

    ``apply`` sets them; calling the object (the undo) gives every unit the
    policy and the parameter groups it had, reshards, and has FSDP rebuild its
    gathered parameters in the old dtype at the next forward.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        #: (state, its policy before)
        self.states: List[Tuple[Any, Any]] = []
        #: (state, group, its policy before, its FSDPParams before, the group split from it or None)
        self.groups: List[Tuple[Any, Any, Any, List[Any], Optional[Any]]] = []

    def apply(self, half: torch.dtype, kept_modules: Set[int]) -> None:
        """Give every unit of the model O2's policies; ``kept_modules``: ``id`` of every
        module that stays FP32 (kept ones and everything inside them). Records each
        change before making the next, so the undo covers a failure half way."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        quiet = MixedPrecisionPolicy(cast_forward_inputs=False)  # amp_patch's hooks cast inputs and outputs
        for st in states(self.model):
            self.states.append((st, st._mp_policy))
            st._mp_policy = quiet
            for g in groups(st):
                if not g.fsdp_params:
                    continue
                lazy = _initialized(g)
                if lazy:
                    g.reshard()
                before = list(g.fsdp_params)
                kept = [fp for fp in before if any(id(m) in kept_modules for m in _modules_of(fp))]
                rest = [fp for fp in before if not any(id(m) in kept_modules for m in _modules_of(fp))]
                reduce = g.mp_policy.reduce_dtype or f32
                half_policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=reduce, cast_forward_inputs=False)
                fp32_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=f32, cast_forward_inputs=False)
                if kept and rest:
                    new = _split_group(st, g, kept, fp32_policy)
                    self.groups.append((st, g, g.mp_policy, before, new))
                    _set_policy(g, half_policy, lazy)
                    _set_policy(new, fp32_policy, lazy)
                    if lazy:
                        new.lazy_init()
                else:
                    self.groups.append((st, g, g.mp_policy, before, None))
                    _set_policy(g, fp32_policy if kept else half_policy, lazy)
            _reindex(st)

    def __call__(self) -> None:
        for st, g, policy, before, new in reversed(self.groups):
            lazy = _initialized(g)
            if lazy:
                g.reshard()
                if new is not None:
                    new.reshard()
            if new is not None:
                lst = st._fsdp_param_groups
                if any(x is new for x in lst):
                    lst.remove(new)
                for handles in (new._module_to_pre_save_state_dict_hook_handle, new._module_to_pre_load_state_dict_hook_handle):
                    for h in handles.values():
                        h.remove()
                    handles.clear()
                g.fsdp_params = before
            _set_policy(g, policy, lazy)
            _reindex(st)
        for st, policy in reversed(self.states):
            st._mp_policy = policy
        self.groups.clear()
        self.states.clear()


def _initialized(group: Any) -> bool:
    """Whether FSDP has set the group's dtypes up (its lazy init, at the first forward)."""
    return hasattr(group, "_orig_dtype")


def _set_policy(group: Any, policy: Any, lazy: bool) -> None:
    group.mp_policy = policy
    for fp in group.fsdp_params:
        fp.mp_policy = policy
    if lazy:
        # the dtypes FSDP derived from the old policy, and the gathered parameters it
        # allocated in them, go: the next all-gather builds them in the new dtype
        group._init_mp_dtypes()
        for fp in group.fsdp_params:
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param


def _split_group(state: Any, group: Any, kept: List[Any], policy: Any) -> Any:
    """Move ``kept`` out of ``group`` into a new parameter group of the same unit,
    right after it, with ``policy``; the two then gather, reduce and reshard each
    in its own dtype. The parameters stay sharded as they are (no collective)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if not isinstance(getattr(state, "_fsdp_param_groups", None), list):
        raise ConfigError(
            "this torch's FSDP keeps one parameter group per fully_shard unit, so amp_patch cannot keep a batch "
            "norm (or keep_fp32 module) in FP32 inside a half unit. fully_shard each such module itself before "
            "its block: for m in model.modules(): if isinstance(m, nn.BatchNorm2d): fully_shard(m)"
        )
    new = FSDPParamGroup([], group.modules, group.mesh_info, group.post_forward_mesh_info, group.device, None,
                         policy, group.offload_policy)
    for name in _SETTINGS:
        if name in vars(group):
            setattr(new, name, getattr(group, name))
    new.fsdp_params = list(kept)
    keep = {id(fp) for fp in kept}
    group.fsdp_params = [fp for fp in group.fsdp_params if id(fp) not in keep]
    lst = state._fsdp_param_groups
    lst.insert(lst.index(group) + 1, new)
    return new


def _reindex(state: Any) -> None:
    lst = groups(state)
    for i, g in enumerate(lst):
        g._param_group_index = i
        g._num_param_groups = len(lst)


def apply(model: nn.Module, half: torch.dtype, kept_modules: Set[int]) -> Policies:
    """Give ``model``'s units O2's policies (see ``Policies.apply``); returns the undo,
    to be pushed by the caller before anything else can fail. On failure the
    changes made so far are undone and the error raised."""
    pol = Policies(model)
    try:
        pol.apply(half, kept_modules)
    except BaseException:
        pol()
        raise
    return pol


def kept_inside(model: nn.Module, kept: Set[int]) -> Set[int]:
    """``id`` of every module of ``model`` inside (or equal to) one in ``kept``."""
    out: Set[int] = set()
    for m in model.modules():
        if id(m) in kept:
            out.update(id(x) for x in m.modules())
    return out


def shard_bytes(params: Iterable[Tensor]) -> Tuple[int, int]:
    """``(bytes of this rank's local shards, bytes of the whole tensors)`` of ``params``."""
    mine = whole = 0
    for p in params:
        loc = local(p)
        mine += loc.numel() * loc.element_size()
        whole += p.numel() * p.element_size()
    return mine, whole


__all__ = ["apply", "check_model", "dtensor_type", "check_optimizer", "fsdp_params", "groups", "is_dtensor", "is_unit", "kept_inside", "local",
           "Policies", "shard_bytes", "sharded", "sharded_ids", "stale_hint", "states", "unsharded_ids"]
