"""Model conversion for O2/O3/O5: a half-precision model, FP32 where it matters.

``attach`` casts each model's floating parameters and buffers to the half
dtype in place (parameter objects keep their identity, so references held
elsewhere stay valid), except batchnorm layers under ``keep_batchnorm_fp32``
and the modules a ``keep_fp32`` filter selects. It then builds FP32 master
weights for the optimizers (``master.py``).

Everything is done with hooks, never by replacing ``forward``: a forward
pre-hook casts the model's inputs to the half dtype, a forward hook casts its
outputs (FP32 by default), a ``state_dict`` hook writes FP32 values (the masters
where they exist) and a ``load_state_dict`` pre-hook loads FP32 values into the
masters. The hooks are small module-level classes, so ``copy.deepcopy``,
pickling, ``nn.DataParallel``, DDP and ``torch.compile`` see an ordinary module.
The checkpoint hooks find the masters through the running session's
``Conversions`` at call time, so a deep copy (which has no masters) saves its
own half values.
"""
from __future__ import annotations

import difflib
import fnmatch
import itertools
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import copies
from ..base.errors import ConfigError, StateError
from ..config import AmpConfig
from ..patching.cast import CASTABLE, LOW, cast, needs_cast
from . import compat, fsdp, master
from .conversions import Conversions, current

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ..base.undo import Owned
    from ..config.config import KeepFP32

log = logging.getLogger("amp_patch")

Tensor = torch.Tensor
f32 = torch.float32

#: modules whose kernels take half inputs with FP32 parameters natively, so a
#: kept-FP32 one needs no cast of its inputs
_MIXED_INPUT_OK = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)

#: layers torch has no CPU kernel for in these half dtypes (torch 2.13): in a CPU
#: model they stay FP32 as a kept batchnorm does (inputs cast up, the output back
#: to the half dtype) instead of raising "not implemented for 'BFloat16'"
_NO_HALF_CPU_KERNEL = (
    (nn.AvgPool3d, LOW), (nn.LPPool3d, LOW), (nn.LocalResponseNorm, LOW),  # avg_pool3d
    (nn.CTCLoss, LOW), (nn.MultiMarginLoss, LOW), (nn.MultiLabelMarginLoss, LOW),
    (nn.RReLU, (torch.float16,)),
)

#: kept FP32 with the batchnorms (``keep_batchnorm_fp32``): a parametrization
#: (``nn.utils.parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``)
#: computes its layer's weight from an FP32 original, and the weight joins the half
#: model through the kept module's output cast. In half, ``orthogonal``'s
#: ``torch.matrix_exp`` returns NaN after one step, and the norms lose the bits.
_KEPT_WITH_BATCHNORM = (nn.modules.batchnorm._BatchNorm, nn.utils.parametrize.ParametrizationList)

Filter = Callable[[nn.Module, str], bool]


# ------------------------------------------------------------------ hooks


class CastInputs:
    """Forward pre-hook: cast floating inputs (args and kwargs) to ``dtype``.

    ``probe``: ``(module, name)`` of one converted parameter. When a call
    swaps the parameters for others (``torch.func.functional_call(model,
    fp32_params, x)``), the inputs follow the dtype of the one in use there,
    so the call computes in the precision of the parameters it was given.
    """

    def __init__(self, dtype: torch.dtype, probe: Optional[Tuple[nn.Module, str]] = None):
        self.dtype = dtype
        self.probe = probe

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        to = self.dtype
        if self.probe is not None:
            used = self.probe[0]._parameters.get(self.probe[1])
            if used is not None and used.dtype is not to and used.dtype in CASTABLE:
                to = used.dtype
        if needs_cast(args, to) or (kwargs and needs_cast(kwargs, to)):
            return cast(args, to, None), cast(kwargs, to, None)
        return None

    def __repr__(self) -> str:
        return f"amp_patch.CastInputs({self.dtype})"


class CastOutputs:
    """Forward hook: cast floating outputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: object):
        return cast(output, self.dtype, None)

    def __repr__(self) -> str:
        return f"amp_patch.CastOutputs({self.dtype})"


class SaveFP32:
    """``state_dict`` post-hook: write each converted tensor in ``save_dtype``.

    A parameter with a master is written from the master (its exact FP32
    value); any other half tensor is cast. Only this module's own tensors are
    touched: each converted module has its own hook, so ``submodule.state_dict()``
    is converted too.
    """

    def __init__(self, save_dtype: torch.dtype):
        self.save_dtype = save_dtype

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        conv = current()
        to = self.save_dtype
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or key not in state_dict:
                continue
            m = master.lookup(conv, p)
            value = state_dict[key]
            if m is not None:
                conv.masters_holding(m).weight_writes.take()  # a write to the half model since the step counts
                if to == f32:
                    # a view of the master, as plain torch returns a view of the
                    # parameter: a write into it reaches the half model too
                    state_dict[key] = m if value is p else m.detach()
                else:
                    state_dict[key] = m.detach().to(to)
            elif p.dtype in LOW and p.dtype != to:
                exact = _exact_value(p)  # a frozen parameter: its value from before the cast
                if exact is not None and exact.dtype == to:
                    state_dict[key] = exact.detach()  # a view, as plain torch's: a write reaches the half model
                    _hand_out(conv, id(p))
                else:
                    state_dict[key] = value.detach().to(to)
        for name, b in module._buffers.items():
            key = prefix + name
            if b is not None and key in state_dict and b.dtype in LOW and b.dtype != to:
                exact = _exact_buffer(conv, module, name, b)
                if exact is not None and exact.dtype == to:
                    state_dict[key] = exact
                    _hand_out(conv, (id(module), name))
                else:
                    state_dict[key] = state_dict[key].detach().to(to)


def _hand_out(conv: Conversions, key: Union[int, Tuple[int, str]]) -> None:
    """Check the pre-cast value under ``key`` for writes before each forward from now on."""
    for rec in conv.records:
        e = rec.exact.get(key)
        if e is not None:
            rec.handed_out[key] = e
            return


class SyncWritten:
    """Forward pre-hook of a converted model: masters written through a
    ``state_dict()`` view since the last step reach the half model first.

    It also refuses a forward after the script changed the model's dtype
    itself (``model.float()``, ``.half()``, ``.to(dtype)``): the half model and
    its masters no longer match, and torch's own error would not say why.
    ``probe`` is one converted parameter, ``dtype`` what it was converted to.
    """

    def __init__(self, probe: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None):
        self.probe, self.dtype = probe, dtype

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            # a version counter is not a value a graph can branch on: a compiled
            # forward leaves the writes to the next eager forward or step, which
            # copies every master into the model
            return
        conv = current()
        if conv is None:
            return
        probe = self.probe
        if probe is not None and probe.dtype is not self.dtype:
            raise StateError(
                f"{type(module).__name__}'s parameters are {probe.dtype} now, but amp_patch converted the model to "
                f"{self.dtype} at opt_level={conv.config.opt_level!r} and keeps FP32 master weights for it; "
                f"model.float(), .half() or .to(dtype) after initialize breaks that. To evaluate or export in FP32, "
                f"use a copy (copy.deepcopy(model) is a plain FP32 model) or call amp_patch.deinitialize() first; "
                f"for another half dtype, deinitialize and initialize again with half_dtype=..."
            )
        for mw in conv.masters():
            mw.weight_writes.sync()
        for rec in conv.records:
            for e in rec.handed_out.values():
                e.sync()

    def __repr__(self) -> str:
        return f"amp_patch.SyncWritten({self.dtype})"


class LateShard:
    """A global forward pre-hook while ``torch.distributed.fsdp`` is imported and
    converted models have not run a forward yet: a model ``fully_shard``-ed after
    ``initialize`` converted it is refused at its first forward, before FSDP's own
    hooks run (they would fail on the half and FP32 parameters of one unit, or
    train copies of the half weights the masters no longer reach), naming the
    order that works. Each model is looked at once; the hook goes when all have been,
    or after ``LIMIT`` module calls (a script that only ever calls a model's parts)."""

    LIMIT = 1000

    def __init__(self, models: Sequence[nn.Module]):
        self.pending = {id(m) for m in models}
        self.calls = 0
        self.handle = nn.modules.module.register_module_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return  # nothing to trace into a graph: an eager call looks
        self.calls += 1
        if self.calls >= self.LIMIT:
            self.handle.remove()
        if id(module) not in self.pending:
            return
        self.pending.discard(id(module))
        if not self.pending:
            self.handle.remove()
        conv = current()
        if conv is not None and fsdp.sharded(module):
            raise StateError(
                f"{type(module).__name__} was sharded by fully_shard after amp_patch.initialize converted it at "
                f"opt_level={conv.config.opt_level!r}: FSDP took over the half parameters whose FP32 masters the "
                f"optimizer steps. The order that works: {fsdp.ORDER}; amp_patch then gives FSDP the policies "
                f"O2 means, FSDP's FP32 shards being the masters. (amp_patch.deinitialize() first, to start over.)"
            )

    def __repr__(self) -> str:
        return "amp_patch.LateShard()"

    def undo(self) -> None:
        self.handle.remove()


class LoadIntoMasters:
    """``load_state_dict`` pre-hook: copy incoming values into the masters.

    The load itself then copies them into the half parameters (rounding), so
    masters keep the exact FP32 values of the checkpoint.
    """

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *rest: object) -> None:
        conv = current()
        if conv is None:
            return
        pairs = []
        for name, p in module._parameters.items():
            m = master.lookup(conv, p) if p is not None else None
            if m is not None and prefix + name in state_dict:
                pairs.append((m, state_dict[prefix + name]))
            elif p is not None and prefix + name in state_dict:
                _keep_loaded(conv, id(p), state_dict[prefix + name])
        for name, b in module._buffers.items():
            if b is not None and prefix + name in state_dict:
                _keep_loaded(conv, (id(module), name), state_dict[prefix + name])
        if not pairs:
            return
        if local_metadata.get("assign_to_params_buffers", False):
            raise StateError(
                f"{type(module).__name__}.load_state_dict(..., assign=True) would replace the half-precision "
                f"parameters amp_patch manages with the checkpoint's tensors. Load without assign=True "
                f"(values are copied into the FP32 masters and the half model)."
            )
        with torch.no_grad():
            for m, value in pairs:
                if isinstance(value, Tensor) and value.shape == m.shape:
                    m.copy_(value)


def _keep_loaded(conv: Conversions, key: Union[int, Tuple[int, str]], value: object) -> None:
    """A checkpoint value loaded into a converted tensor with no master (O3, a
    frozen parameter, a buffer) becomes its exact value, so a ``state_dict()``
    right after the load gives back what was loaded, not its half rounding."""
    for rec in conv.records:
        e = rec.exact.get(key)
        if e is None:
            continue
        if isinstance(value, Tensor) and value.shape == e.original.shape and value.is_floating_point():
            e.original = value.detach().to(device=e.original.device, dtype=e.original.dtype, copy=True)
            e.version = e.original._version
        return


#: amp_patch's module hooks: a copy of any model drops them (``precision.copies``),
#: as a pickle must (``torch.load``'s default ``weights_only=True`` refuses
#: amp_patch's classes): ``cast_outputs`` puts ``CastOutputs`` on a model that
#: O1 leaves unconverted, whose copy rule is ``run.flight``'s
_HOOK_TYPES = (CastInputs, CastOutputs, SaveFP32, LoadIntoMasters, SyncWritten)
copies.drop_on_copy(*_HOOK_TYPES)


# ------------------------------------------------------------------ options


def _filter(keep_fp32: "KeepFP32", models: Sequence[nn.Module]) -> Optional[Filter]:
    """``AmpConfig.keep_fp32`` as a ``(module, name) -> bool`` filter; ConfigError
    when a pattern matches no module of ``models``."""
    if keep_fp32 is None or callable(keep_fp32):
        return keep_fp32
    names = [(n, type(m).__name__) for model in models for n, m in model.named_modules() if n]
    for pat in keep_fp32:
        if not any(fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(c, pat) for n, c in names):
            pool = sorted({n for n, _ in names} | {c for _, c in names})
            near = difflib.get_close_matches(pat, pool, 3)
            hint = f"; did you mean {', '.join(repr(x) for x in near)}?" if near else ""
            raise ConfigError(
                f"keep_fp32 pattern {pat!r} matches no module name or class name of the model(s){hint} "
                f"(patterns are matched with fnmatch against dotted names like 'encoder.layers.0.norm1' "
                f"and class names like 'LayerNorm')"
            )
    return _PatternFilter(tuple(keep_fp32))


class _PatternFilter:
    def __init__(self, patterns: Tuple[str, ...]):
        self.patterns = patterns

    def __call__(self, module: nn.Module, name: str) -> bool:
        cls = type(module).__name__
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cls, p) for p in self.patterns)


def validate(models: Sequence[nn.Module], config: AmpConfig) -> None:
    """Check the models and the model options before anything changes.

    Raises:
        ConfigError: naming the model or option and the fix.
    """
    compat.check_models(models, config)
    casts_half = config.cast_model_type in LOW
    if config.keep_fp32 is not None:
        if not casts_half:
            raise ConfigError(
                f"keep_fp32 keeps modules of a half-precision model in FP32, but opt_level={config.opt_level!r} "
                f"does not cast the model; use it with O2, O3 or O5"
            )
        _filter(config.keep_fp32, models)

    for i, m in enumerate(models):
        scripted = next((n for n, sub in m.named_modules() if isinstance(sub, torch.jit.ScriptModule)), None)
        if casts_half and scripted is not None:
            where = f"its submodule {scripted!r}" if scripted else "it"
            raise ConfigError(
                f"model {i} ({type(m).__name__}) cannot be converted at opt_level={config.opt_level!r}: {where} is a "
                f"torch.jit.script-ed module, whose parameters and compiled code torch does not let amp_patch cast "
                f"and hook safely. Initialize the plain (unscripted) model and script it afterwards if you must, "
                f"or use O1/O4, which leave the model as it is."
            )
        if casts_half and isinstance(m, nn.parallel.DistributedDataParallel):
            raise ConfigError(
                f"model {i} is wrapped in DistributedDataParallel, which fixed its gradient buckets to FP32. "
                f"Call amp_patch.initialize on the plain model first, then wrap it: "
                f"model, opt = amp_patch.initialize(model, opt, ...); model = DDP(model)"
            )
    if casts_half:
        _refuse_uninitialized(models, config.opt_level)


# ------------------------------------------------------------------ conversion


class Conversion:
    """What conversion changed in one model, to undo it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params: List[Tuple[Tensor, torch.dtype]] = []  # (parameter, dtype before)
        self.buffers: List[Tuple[nn.Module, str, torch.dtype]] = []  # (module, name, dtype before)
        self.handles: List["RemovableHandle"] = []
        self.rnns: List[nn.Module] = []
        self.copyable = False  # copies.install ran on the model
        #: the model's input cast (O2/O3/O5): what the launcher applies where a
        #: script calls a submodule with no call of the model around it
        self.edge: Optional[CastInputs] = None
        #: id(parameter) or (id(module), buffer name) -> _Exact, the pre-cast value
        self.exact: Dict[Union[int, Tuple[int, str]], "_Exact"] = {}
        #: the ones ``state_dict()`` handed out, checked for writes before each forward
        self.handed_out: Dict[Union[int, Tuple[int, str]], "_Exact"] = {}


def _kept_modules(model: nn.Module, keep_bn: bool, keep: Optional[Filter]) -> set:
    """``id`` of each module that stays FP32: kept batchnorms (and parametrizations,
    ``_KEPT_WITH_BATCHNORM``), ``keep_fp32``'s matches, and every module that shares a parameter with one of them (a head
    tied to the embedding): a tie across the half/FP32 boundary would make the
    shared weight half on one side and FP32 on the other, so both sides stay
    FP32 and their outputs rejoin the half model."""
    kept = set()
    kept_params: set = set()
    for name, mod in model.named_modules():
        if (keep_bn and isinstance(mod, _KEPT_WITH_BATCHNORM)) or (keep is not None and name and keep(mod, name)):
            kept.add(id(mod))
            kept_params.update(id(p) for p in mod.parameters())
    if not kept:
        return kept
    inside = {id(m) for mod in model.modules() if id(mod) in kept for m in mod.modules()}
    grew = True
    while grew:  # a module kept for a tie may be tied to another in turn
        grew = False
        for name, mod in model.named_modules():
            if id(mod) in inside:
                continue
            own = [id(p) for p in mod._parameters.values() if p is not None]
            if any(i in kept_params for i in own):
                log.info("amp_patch: %s shares a parameter with a module kept in FP32, so it is kept in FP32 too", name or "the model")
                kept.add(id(mod))
                inside.update(id(m) for m in mod.modules())
                kept_params.update(id(p) for p in mod.parameters())
                grew = True
    return kept


def _without_half_kernel(model: nn.Module, dtype: torch.dtype) -> set:
    """``id`` of each layer of a CPU ``model`` that torch cannot run in ``dtype``
    (``_NO_HALF_CPU_KERNEL``); these hold no parameters, so no tie crosses them."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    if first is None or first.device.type != "cpu":
        return set()
    lacking = tuple(cls for cls, dtypes in _NO_HALF_CPU_KERNEL if dtype in dtypes)
    return {id(m) for m in model.modules() if isinstance(m, lacking)}


def _refuse_uninitialized(models: Sequence[nn.Module], level: str) -> None:
    """A lazy module (``nn.LazyLinear``) has no parameters to cast before its
    first forward pass: say so, instead of failing inside the conversion."""
    for i, model in enumerate(models):
        for name, mod in model.named_modules():
            if isinstance(mod, nn.modules.lazy.LazyModuleMixin) and mod.has_uninitialized_params():
                raise ConfigError(
                    f"model {i} ({type(model).__name__}): {type(mod).__name__} {name or '(the model)'!r} is a lazy "
                    f"module whose parameters do not exist before its first forward pass, so opt_level={level!r} "
                    f"cannot cast them. Run one forward pass on a sample batch before amp_patch.initialize."
                )


def _convert(rec: "Conversion", dtype: torch.dtype, out_dtype: torch.dtype, keep_bn: bool, keep: Optional[Filter],
             save_dtype: torch.dtype, originals: Dict[int, tuple]) -> None:
    """Cast ``rec.model`` in place, recording each change in ``rec`` as it is made."""
    model = rec.model
    skip = set()
    seen_params = set()
    kept_ids = _kept_modules(model, keep_bn, keep) | _without_half_kernel(model, dtype)
    for name, mod in model.named_modules():
        if id(mod) in skip:
            continue
        if id(mod) in kept_ids:
            skip.update(id(m) for m in mod.modules())
            if not isinstance(mod, _MIXED_INPUT_OK):
                rec.handles.append(mod.register_forward_pre_hook(CastInputs(f32), with_kwargs=True))
            # the output rejoins the half model; a norm that takes half input may
            # still return its weights' dtype (Apex's MixedFusedLayerNorm returns FP32)
            rec.handles.append(mod.register_forward_hook(CastOutputs(dtype)))
            continue
        changed = False
        for p in mod._parameters.values():
            if p is None or id(p) in seen_params or p.dtype not in CASTABLE or p.dtype == dtype:
                continue
            seen_params.add(id(p))
            grad, old = p.grad, p.data
            originals[id(p)] = (old, grad, p.dtype)
            new = old.to(dtype)
            p.grad = None
            rec.params.append((p, p.dtype))
            rec.exact[id(p)] = _Exact(p, old)
            p.data = new
            if grad is not None and dtype not in LOW:
                p.grad = grad.to(dtype)
            changed = True
        for bname, b in mod._buffers.items():
            if b is not None and b.dtype in CASTABLE and b.dtype != dtype:
                rec.buffers.append((mod, bname, b.dtype))
                new = mod._buffers[bname] = b.to(dtype)
                rec.exact[(id(mod), bname)] = _Exact(new, b)
                changed = True
        if changed or _holds_half(mod):
            _checkpoint_hooks(mod, save_dtype, rec)
        if changed and isinstance(mod, nn.RNNBase):
            rec.rnns.append(mod)
            mod.flatten_parameters()
    probe = next((p for p, _ in rec.params if p.dtype == dtype), None)
    rec.handles.append(model.register_forward_pre_hook(SyncWritten(probe, dtype)))
    where = next(((m, n) for m in model.modules() for n, p in m._parameters.items() if p is probe), None) if probe is not None else None
    rec.edge = CastInputs(dtype, where)
    rec.handles.append(model.register_forward_pre_hook(rec.edge, with_kwargs=True))
    rec.handles.append(model.register_forward_hook(CastOutputs(out_dtype)))
    dtypes: Dict[Any, torch.dtype] = {id(p): d for p, d in rec.params}
    dtypes.update({(id(mod), name): d for mod, name, d in rec.buffers})
    rec.copyable = True
    copies.install(model, copies.Plan(_exact_value, dtypes, _HOOK_TYPES,
                                      lambda mod, name, b: _exact_buffer(current(), mod, name, b)))
    if rec.params:
        copies.install_save_pretrained(model, rec.params[0][1])


def _convert_sharded(undo: "Owned", rec: "Conversion", dtype: torch.dtype, out_dtype: torch.dtype, keep_bn: bool,
                     keep: Optional[Filter], save_dtype: torch.dtype) -> None:
    """O2/O5 on a ``fully_shard``-ed model (``fsdp``): its parameters stay FSDP's FP32
    shards, the masters the optimizer steps, and FSDP is given the policies that
    gather them in ``dtype`` (FP32 for the modules kept FP32); the rest is what
    ``_convert`` does to an unsharded model: the same hooks (inputs to ``dtype``,
    outputs to ``out_dtype``, kept modules' inputs and outputs) and the other
    modules' floating buffers cast to ``dtype``, so the model computes what the
    unsharded one computes."""
    model = rec.model
    kept_ids = _kept_modules(model, keep_bn, keep) | _without_half_kernel(model, dtype)
    skip: set = set()
    for name, mod in model.named_modules():
        if id(mod) in skip:
            continue
        if id(mod) in kept_ids:
            skip.update(id(m) for m in mod.modules())
            if not isinstance(mod, _MIXED_INPUT_OK):
                rec.handles.append(mod.register_forward_pre_hook(CastInputs(f32), with_kwargs=True))
            rec.handles.append(mod.register_forward_hook(CastOutputs(dtype)))
            continue
        changed = False
        for bname, b in mod._buffers.items():
            if b is not None and b.dtype in CASTABLE and b.dtype != dtype:
                rec.buffers.append((mod, bname, b.dtype))
                new = mod._buffers[bname] = b.to(dtype)
                rec.exact[(id(mod), bname)] = _Exact(new, b)
                changed = True
        if changed:
            _checkpoint_hooks(mod, save_dtype, rec)
    undo.push(fsdp.apply(model, dtype, fsdp.kept_inside(model, kept_ids)))
    # the parameters a forward sees are FSDP's gathered ones, in their unit's dtype: no probe
    rec.edge = CastInputs(dtype)
    rec.handles.append(model.register_forward_pre_hook(rec.edge, with_kwargs=True))
    rec.handles.append(model.register_forward_hook(CastOutputs(out_dtype)))


def _exact_value(param: Tensor) -> Optional[Tensor]:
    """The exact value from before the cast of a converted parameter: its
    master's where an optimizer holds one, else the value kept at conversion
    while the half parameter has not changed since."""
    conv = current()
    m = master.lookup(conv, param)
    if m is not None or conv is None:
        return m
    for rec in conv.records:
        e = rec.exact.get(id(param))
        if e is not None and e.half is param:
            return e.value()
    return None


def _exact_buffer(conv: Optional[Conversions], module: nn.Module, name: str, buf: Tensor) -> Optional[Tensor]:
    """A converted buffer's value from before the cast, while the half one has not changed since."""
    if conv is None:
        return None
    for rec in conv.records:
        e = rec.exact.get((id(module), name))
        if e is not None and e.half is buf:
            return e.value()
    return None


class _Exact:
    """The pre-cast value of a converted tensor no optimizer owns (a frozen
    parameter, a buffer), kept so that ``state_dict()``, copies and
    ``deinitialize`` give it back exactly, as long as the half tensor still
    holds it rounded: a frozen parameter always does; a running statistic,
    which kernels update without bumping a version counter, soon does not,
    and then its current half value is the truth. The comparison costs one
    pass over the tensor, paid only by those three (never by a step)."""

    __slots__ = ("half", "original", "version")

    def __init__(self, half: Tensor, original: Tensor):
        self.half, self.original = half, original
        self.version = original._version

    @torch.no_grad()
    def sync(self) -> None:
        """A write into the value ``state_dict()`` handed out (``sd[k].copy_(v)``,
        as plain torch allows) reaches the half tensor."""
        original = self.original
        if original._version != self.version:
            self.half.copy_(original)
            self.version = original._version

    def value(self) -> Optional[Tensor]:
        self.sync()
        half, original = self.half, self.original
        if half.device != original.device or half.shape != original.shape:
            return None
        return original if torch.equal(original.to(half.dtype), half) else None


def _holds_half(mod: nn.Module) -> bool:
    return any(p is not None and p.dtype in LOW for p in mod._parameters.values())


def _checkpoint_hooks(mod: nn.Module, save_dtype: torch.dtype, rec: Conversion) -> None:
    rec.handles.append(mod.register_state_dict_post_hook(SaveFP32(save_dtype)))
    rec.handles.append(mod.register_load_state_dict_pre_hook(LoadIntoMasters()))


def _hook_only(model: nn.Module, save_dtype: torch.dtype) -> Conversion:
    """``cast_model_type=False`` with masters: no casts, FP32 checkpoints of the half parameters."""
    rec = Conversion(model)
    for mod in model.modules():
        if _holds_half(mod):
            _checkpoint_hooks(mod, save_dtype, rec)
    return rec


def cast_outputs(conv: Conversions, model: nn.Module) -> None:
    """At O1/O4 (the model keeps its dtypes): cast ``model``'s floating outputs
    to ``cast_model_outputs`` (Apex's option), undone with the run. A model
    whose outputs are cast already is left as it is."""
    if any(rec.model is model for rec in conv.records):
        return
    rec = Conversion(model)
    conv.records.append(rec)
    conv.undo.push(_Unconvert(rec))
    if "__deepcopy__" not in model.__dict__:
        # a copy or pickle (torch.save(model)) leaves the hook behind: the
        # launcher's models have no other copy rule at O1
        copies.install_hook_drop(model)
        rec.copyable = True
    rec.handles.append(model.register_forward_hook(CastOutputs(conv.config.cast_model_outputs)))


class _Unconvert:
    """Undo callback for one converted model (a class, so the record is inspectable)."""

    def __init__(self, rec: Conversion):
        self.rec = rec

    @torch.no_grad()
    def __call__(self) -> None:
        rec = self.rec
        if rec.copyable:
            copies.remove(rec.model)
        for h in reversed(rec.handles):
            h.remove()
        for p, dtype in rec.params:
            if p.dtype != dtype:  # a parameter with a master is already back (master.restore)
                grad, p.grad = p.grad, None
                e = rec.exact.get(id(p))
                exact = e.value() if e is not None and e.half is p else None
                p.data = exact if exact is not None else p.data.to(dtype)
                if grad is not None:
                    p.grad = grad.to(dtype)
        for mod, name, dtype in rec.buffers:
            b = mod._buffers.get(name)
            if b is not None and b.dtype != dtype:
                e = rec.exact.get((id(mod), name))
                exact = e.value() if e is not None and e.half is b else None
                mod._buffers[name] = exact if exact is not None else b.to(dtype)
        rec.exact.clear()
        rec.handed_out.clear()
        for mod in rec.rnns:
            mod.flatten_parameters()


def attach(conv: Conversions, models: Sequence[nn.Module], config: AmpConfig) -> Dict[int, tuple]:
    """Convert ``models`` with this call's ``config`` (its ``keep_fp32``, ``save_dtype``).

    Returns ``{id(parameter): (FP32 data, FP32 grad, dtype)}`` from before the
    cast, on which the masters are built (``optimizers.attach``).

    Each change pushes its undo onto ``conv.undo`` as it is made, so a failure
    half way, or ``deinitialize``, restores the models.
    """
    originals: Dict[int, tuple] = {}
    dtype = config.cast_model_type
    if dtype is not None:
        keep = _filter(config.keep_fp32, models)
        keep_bn = bool(config.keep_batchnorm_fp32)
        out_dtype = config.cast_model_outputs or f32
        save_dtype = config.save_dtype
        for m in models:
            rec = Conversion(m)
            # registered before the first change, so a failure half way is undone too
            conv.records.append(rec)
            conv.undo.push(_Unconvert(rec))
            if fsdp.sharded(m):
                _convert_sharded(conv.undo, rec, dtype, out_dtype, keep_bn, keep, save_dtype)
            else:
                _convert(rec, dtype, out_dtype, keep_bn, keep, save_dtype, originals)
        plain = [m for m in models if not fsdp.sharded(m)]
        if plain and config.master_weights and "torch.distributed.fsdp" in sys.modules:
            late = LateShard(plain)
            conv.undo.push(late.undo)
    elif config.master_weights:
        save_dtype = config.save_dtype
        for m in models:
            rec = _hook_only(m, save_dtype)
            conv.records.append(rec)
            conv.undo.push(_Unconvert(rec))
    if dtype is None and config.cast_model_outputs is not None:
        for m in models:
            cast_outputs(conv, m)
    return originals
