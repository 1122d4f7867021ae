"""``initialize`` as a plan in three phases.

1. ``configure`` + ``Plan.build`` check everything and change nothing: the
   opt level and options (``config.parse``), the op lists, the models, the
   optimizers, the launcher's provisional hand-off, Apex's rule for another
   ``amp.initialize`` while a run is on, the strict rule for another
   ``amp_patch.initialize``. A bad call raises here with torch untouched (and
   the launcher's session, if one runs, still running).
2. ``Plan.apply`` makes the changes in a fixed order (model conversion,
   optimizer attachment, forward tracking, loss scaling, function patches),
   each pushing its undo onto the session's entries of the process's undo
   stack as it is made.
3. If any change fails, ``apply`` rolls back to the mark it took: a new
   session ends, a joined one is as it was before the call.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import itertools
import logging
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch

from .. import diagnostics, oplists
from ..base import running
from ..base.errors import ConfigError
from ..config import AmpConfig, parse
from ..diagnostics.report import report_of
from ..oplists import NAMESPACES
from ..patching import costs, rnn
from ..patching.registry import PatchItem
from ..patching.cast import LOW
from ..patching.wrappers import attention_wrapper, make_wrapper, pop_disabled, push_disabled
from ..precision import fp8
from ..precision import model as model_side
from ..precision import optimizers as optimizers_side
from ..scaling import optimizer as optimizer_scaling
from ..scaling import state as scaling_state
from ..scaling.checkpoint import counters_of
from . import flight
from .session import Session

log = logging.getLogger("amp_patch")

#: ``(owner, name, policy)`` of a ``register_*_function`` call
Registration = Tuple[object, str, str]


# ---------------------------------------------------------------- what was given


@dataclasses.dataclass(frozen=True)
class Given:
    """The models and optimizers of one call, as lists, and the structure they
    came in (``initialize`` hands them back in it)."""

    models: Tuple[torch.nn.Module, ...]
    optimizers: Tuple[object, ...]  # torch optimizers, or a wrapper with one inside (Apex's LARC)
    models_arg: object
    optimizers_arg: object
    models_were_list: bool
    optimizers_were_list: bool

    @classmethod
    def of(cls, models: object, optimizers: object) -> "Given":
        """Check the arguments' types; ConfigError naming the bad one."""
        m, m_list = _as_list(models, "models")
        o, o_list = _as_list(optimizers, "optimizers")
        return cls(tuple(m), tuple(o), models, optimizers, m_list, o_list)  # type: ignore[arg-type]

    @property
    def inner_optimizers(self) -> List[torch.optim.Optimizer]:
        """The torch optimizer of each given one (LARC's ``optim``)."""
        return [optimizers_side.inner_optimizer(o) for o in self.optimizers]  # type: ignore[misc]

    def returned(self) -> object:
        """``initialize``'s result: what it was given, in the structure it was given."""
        if self.models_were_list:
            out_models: object = list(self.models)
        else:
            out_models = self.models[0] if self.models else self.models_arg
        if self.optimizers_arg is None:
            return out_models
        return out_models, (list(self.optimizers) if self.optimizers_were_list else self.optimizers[0])


def _as_list(obj: object, what: str) -> Tuple[List[object], bool]:
    if obj is None:
        return [], False
    items, was_list = (list(obj), True) if isinstance(obj, (list, tuple)) else ([obj], False)
    module = what == "models"
    for i, x in enumerate(items):
        # an optimizer may come wrapped (Apex's LARC): the optimizer inside is attached
        if not (isinstance(x, torch.nn.Module) if module else optimizers_side.inner_optimizer(x) is not None):
            where = f"{what}[{i}]" if was_list else what
            raise ConfigError(
                f"{where} is a {type(x).__module__}.{type(x).__qualname__}; initialize expects "
                f"{'torch.nn.Module' if module else 'torch.optim.Optimizer'} "
                f"(or a list of them). Call amp_patch.initialize(model, optimizer, opt_level=...)."
            )
    return items, was_list


def device_type(models: Sequence[torch.nn.Module]) -> str:
    """The device type of the first tensor of ``models``; else CUDA when there is one."""
    for m in models:
        for t in itertools.chain(m.parameters(), m.buffers()):
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def configure(given: Given, current: Optional[Session], *, opt_level: object, half_dtype: object = None,
              lists: object = None, verbosity: Optional[int] = None, **options: object) -> AmpConfig:
    """This call's ``AmpConfig``, with the launcher's provisional settings
    (its half dtype, op lists and output dtype) where the call names none.

    Changes nothing; raises ConfigError for a bad opt level or option.
    """
    prov = current.provisional if current is not None else None
    inherited = prov is not None and lists is None and prov.lists is not None
    if prov is not None:
        half_dtype = prov.half_dtype if half_dtype is None else half_dtype
        lists = prov.lists if lists is None else lists
        if options.get("cast_model_outputs") is None and prov.cast_model_outputs is not None:
            options["cast_model_outputs"] = prov.cast_model_outputs
    config = parse(opt_level, device_type(given.models), half_dtype=half_dtype, lists=lists, verbosity=verbosity,
                   **options)
    # lists the launcher gave are not this call's: they apply where functions are patched, and say nothing elsewhere
    return dataclasses.replace(config, given=config.given - {"lists"}) if inherited else config


# ---------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
    """One checked ``initialize``: what it will change, and in which session.

    Build it with ``Plan.build``; nothing changes until ``apply``.
    """

    config: AmpConfig
    given: Given
    #: the session the call joins, or None for a new one
    joins: Optional[Session]
    #: a session the call ends first: the launcher's provisional one, or the
    #: run Apex's rule replaces (with ``farewell``, the warning that says so)
    ends: Optional[Session]
    farewell: str
    #: the models and torch optimizers this call attaches (Apex's rule skips held ones)
    models: List[torch.nn.Module]
    optimizers: List[torch.optim.Optimizer]
    #: the op table a new session patches, or None
    table: Optional[dict]
    #: the device type of the call's models (their first tensor's), for the op table and a new session
    device: str
    apex_rules: bool
    registrations: Sequence[Registration]
    #: the session ``apply`` made or joined
    session: Optional[Session] = None

    @property
    def wrappers(self) -> List[object]:
        """The given optimizers that wrap one this call attaches (Apex's ``LARC``)."""
        inner = optimizers_side.inner_optimizer
        return [w for w in self.given.optimizers if inner(w) is not w and any(inner(w) is o for o in self.optimizers)]

    @classmethod
    def build(cls, given: Given, config: AmpConfig, current: Optional[Session], *, apex_rules: bool = False,
              registrations: Sequence[Registration] = ()) -> "Plan":
        """Check everything; change nothing.

        Args:
            given: the call's models and optimizers (``Given.of``).
            config: the call's settings (``configure``).
            current: the running session, or None.
            apex_rules: the call comes through ``amp.initialize``, where
                Apex's "last call wins" replaces the strict rule for a
                running session (``_apex_rule``).
            registrations: the ``register_*_function`` calls a new session patches too.

        Raises:
            ConfigError: a bad model, optimizer, option or combination.
            ListError: invalid op lists.
        """
        prov = current if current is not None and current.provisional is not None else None
        joins = None if prov is not None else current
        models = list(given.models)
        opts = given.inner_optimizers
        plan = cls(config, given, joins, prov, "", models, opts, None, device_type(models), apex_rules, registrations)
        if not config.enabled:
            # apex.amp's enabled=False: everything as it was, the models and optimizers handed back
            plan.joins = None
            return plan
        if config.cast_model_type is not None and not models:
            raise ConfigError(f"opt_level={config.opt_level!r} casts the model, so initialize needs the model (got none)")
        _check_models(models, config)
        if "lists" in config.given and not config.patch_torch_functions:
            raise ConfigError(
                f"lists= overrides the op lists, but opt_level={config.opt_level!r} patches no functions (it casts the "
                f"model instead), so they would do nothing. Use O1 or O4 for op lists, or drop lists="
            )
        if config.patch_torch_functions:
            plan.table = oplists.load(list(config.lists) if config.lists is not None else None).resolve(
                config.half_dtype, plan.device)
        if apex_rules and joins is not None:
            _apex_rule(plan, joins)
        model_side.validate(plan.models, config)
        fp8.validate(plan.models, config)
        optimizers_side.validate(plan.models, plan.optimizers, config,
                                 plan.joins.precision if plan.joins is not None else None,
                                 replacing=prov.precision if prov is not None else None)
        if plan.joins is not None and not apex_rules:
            _strict_rule(plan, plan.joins)
        return plan

    def apply(self) -> object:
        """Make the changes, each pushing its undo; on failure pop back to the
        mark (a new session ends) and raise. Returns ``initialize``'s result."""
        if self.ends is not None:
            if self.farewell:
                # Apex's rule replaced a run: it ends as deinitialize ends one
                diagnostics.warn_user(self.farewell)
                end(self.ends)
            else:
                self.ends.end()  # the launcher's provisional session steps aside
        if not self.config.enabled:
            return self.given.returned()
        fresh = self.joins is None
        amp = self.joins if self.joins is not None else self._new_session()
        self.session = amp
        mark = amp.undo.mark()
        try:
            if fresh:
                running.set_session(amp)
            elif self.apex_rules:
                amp.set_config(amp.config.with_session_options(self.config))
                scaling_state.restart(amp.scaling, amp.config, amp.undo)
                if not len(amp.patcher):
                    # _amp_state.handle._deactivate() took the patches off; Apex's
                    # next amp.initialize patched again, and so does this one
                    items = function_items(amp, self.registrations)
                    if items:
                        amp.patch(items)
            originals = model_side.attach(amp.precision, self.models, self.config)
            fp8.attach(amp.precision, self.models, self.config, amp.diagnostics.ledger)
            built = optimizers_side.attach(amp.precision, self.models, self.optimizers, originals, self.config)
            flight.watch(amp, self.models)
            optimizer_scaling.attach(amp.scaling, amp.undo, self.optimizers, built)
            optimizer_scaling.attach_wrappers(self.wrappers, amp.undo)
            amp.extend(amp.models, self.models)
            amp.extend(amp.optimizers, self.optimizers)
            if fresh:
                items = function_items(amp, self.registrations)
                if items:
                    amp.patch(items)
                ledger = amp.diagnostics.ledger
                if amp.config.patch_torch_functions and ledger is not None:
                    ledger.start(amp.diagnostics)
                if amp.config.find_overflow:
                    diagnostics.arm_find_overflow(amp.diagnostics)
        except BaseException:
            self.rollback(mark, fresh)
            raise
        if fresh and amp.config.verbosity:
            log.info("amp_patch: initialized %s with %s", amp.config.opt_level, amp.config.half_dtype)
            diagnostics.warn_at_initialize(amp.diagnostics, self.models, self.optimizers,
                                           _stepped(amp.scaling, self.optimizers))
        return self.given.returned()

    def rollback(self, mark: int, fresh: bool) -> None:
        """Undo what ``apply`` did: the session it started ends; a joined one
        pops back to ``mark`` (this call's models unconverted, its optimizers as they were)."""
        amp = self.session
        if amp is None:
            return
        if fresh:
            amp.end()
        else:
            amp.undo.pop_to(mark)

    def _new_session(self) -> Session:
        config = self.config
        amp = Session(config, self.table, self.device)
        if config.cast_policy == "auto" and config.patch_torch_functions:
            amp.casting.min_flops = costs.threshold(config.half_dtype, amp.device_type, torch.get_num_threads())
        return amp


def _stepped(scaling: scaling_state.LossScaling, optimizers: Sequence[torch.optim.Optimizer]) -> Set[int]:
    """Ids of the parameters ``optimizers`` step: their own, and the half model
    parameters their FP32 masters stand in for (``diagnostics.warn_at_initialize``)."""
    ids = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    for h in scaling.by_optimizer.values():
        if h.masters is not None and any(h.optimizer is opt for opt in optimizers):
            ids.update(id(p) for p in h.masters.halfs)
    return ids


def _check_models(models: Sequence[torch.nn.Module], config: AmpConfig) -> None:
    for i, m in enumerate(models):
        tensors = list(m.parameters()) + list(m.buffers())
        if any(t.device.type == "meta" for t in tensors):
            raise ConfigError(
                f"model {i} ({type(m).__name__}) has tensors on the meta device. Materialize it first "
                f"(model.to_empty(device='cpu') and load its weights), then call initialize."
            )
        if config.cast_model_type is not None and not any(p.is_floating_point() for p in m.parameters()):
            raise ConfigError(
                f"model {i} ({type(m).__name__}) has no floating-point parameters, so opt_level="
                f"{config.opt_level!r} has nothing to cast. Use O1/O4 (function patching) or pass the model that holds the weights."
            )


def _strict_rule(plan: Plan, amp: Session) -> None:
    """``amp_patch.initialize`` while a session runs: same settings, new models, no new lists."""
    config = plan.config
    if not amp.config.same_level(config):
        raise ConfigError(
            f"amp_patch is already initialized with opt_level={amp.config.opt_level!r}, "
            f"half_dtype={amp.config.half_dtype}; this call asks for opt_level={config.opt_level!r}, "
            f"half_dtype={config.half_dtype}. Use the same settings for every model, or call "
            f"amp_patch.deinitialize() first."
        )
    if "lists" in config.given:
        raise ConfigError("lists= can only be given to the first initialize; call amp_patch.deinitialize() to change the op lists")
    clash = [m for m in plan.models if amp.holds(m)]
    if clash:
        raise ConfigError(f"model {type(clash[0]).__name__} is already initialized; pass each model to initialize once")
    differ = config.differences(amp.config)
    if differ:
        raise ConfigError(
            f"initialize: {', '.join(differ)}: these options belong to the whole session and the first "
            f"initialize set them. Leave them out of this call (or pass the running values), or call "
            f"amp_patch.deinitialize() and initialize everything in one call."
        )


def _apex_rule(plan: Plan, amp: Session) -> None:
    """Apex's rule for another ``amp.initialize`` while a run is on.

    Apex set its properties and loss scalers anew at every call and left the
    earlier models as they were. Here a call with the running settings joins
    the run (the models and optimizers it already holds stay as they are, the
    loss scalers restart with this call's settings, ``scaling.state.restart``);
    a call with other settings ends the earlier run, once every check of the
    new one has passed, and says so.
    """
    if not amp.config.same_level(plan.config) or "lists" in plan.config.given:
        plan.joins, plan.ends, plan.farewell = None, amp, _farewell(amp, plan.config)
        return
    plan.models = [m for m in plan.models if not amp.holds(m)]
    plan.optimizers = [o for o in plan.optimizers if not amp.attached(o)]


def _farewell(old: Session, config: AmpConfig) -> str:
    """What an ``amp.initialize`` with other settings does to the run it ends, in one warning."""
    was = old.config
    lost = []
    if was.cast_model_type in LOW:
        lost.append(f"its {len(old.models)} model(s) are FP32 again")
    if was.patch_torch_functions:
        lost.append("torch functions are no longer cast for them")
    if old.optimizers:
        lost.append(f"its {len(old.optimizers)} optimizer(s) are plain torch optimizers again (no loss scaling, no masters)")
    lost.append("the loss scalers start anew")
    return (
        f"amp.initialize(opt_level={config.opt_level!r}, half dtype {config.half_dtype}) replaced the running "
        f"{was.opt_level} ({was.half_dtype}) run: as in Apex, the last call sets the properties and the loss "
        f"scalers anew. Of the earlier run, {'; '.join(lost)}. To keep every model mixed, initialize them all "
        f"in one call: amp.initialize([model1, model2], [opt1, opt2], opt_level=...)"
    )


# ---------------------------------------------------------------- ending


def end(amp: Session) -> None:
    """End a session: gradients a scaled backward left made true (or dropped),
    its figures kept for ``counters()`` and ``report()``, then every change undone."""
    try:
        scaling_state.settle(amp.scaling)
        patched = collections.Counter(entry.policy for entry in (amp.table or {}).values())
        running.set_ended(running.Ended(counters_of(amp.scaling), report_of(amp.diagnostics), dict(patched)))
    finally:
        amp.end()


# ---------------------------------------------------------------- patch items


def function_items(amp: Session, registrations: Sequence[Registration]) -> List[PatchItem]:
    """What ``amp`` patches: O1/O4 the op lists (and registrations, the
    DataLoader's fetch and the RNN modules' dtype check); a half model (O2/O3/O5)
    under ``cast_policy="auto"`` on CPU, attention alone; otherwise nothing."""
    config = amp.config
    if config.patch_torch_functions:
        return patch_items(amp, registrations) + dataloader_items() + rnn.check_input_items(amp.table or {}, amp.live)
    if config.cast_policy == "auto" and config.cast_model_type in LOW and amp.device_type == "cpu":
        return [attention_item(amp)]
    return []


def patch_items(amp: Session, registrations: Sequence[Registration]) -> List[PatchItem]:
    """(owner, name, make_wrapper) for every op in force, plus user registrations."""
    items: List[PatchItem] = []
    for (ns, name), e in sorted((amp.table or {}).items()):
        items.append((NAMESPACES[ns], name, maker(amp, e.policy, e.qualname, ns == "torch.Tensor", e.fix)))
    for owner, name, policy in registrations:
        items.append(user_item(amp, owner, name, policy))
    return items


def user_item(amp: Session, owner: object, name: str, policy: str) -> PatchItem:
    """The patch item for a ``register_*_function`` registration."""
    qual = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    return (owner, name, maker(amp, policy, qual, isinstance(owner, type), ""))


def maker(amp: Session, policy: str, qualname: str, method: bool, fix: str) -> Callable[[Callable], Callable]:
    """``make_wrapper(original)`` for one op under ``amp``'s settings."""
    def make(original: Callable) -> Callable:
        return make_wrapper(policy, qualname, original, method=method, casting=amp.casting, fix=fix)

    return make


def attention_item(amp: Session) -> PatchItem:
    """A half model (O2/O3/O5) under ``cast_policy="auto"``: attention in FP32 where
    that is faster here (``patching.attention``); the one function these levels patch."""
    return (torch.nn.functional, "scaled_dot_product_attention", lambda original: attention_wrapper(original, amp.live))


def dataloader_items() -> List[PatchItem]:
    """Patch items that run a DataLoader's fetch (dataset and collate) with casting off.

    ``torch.autocast``'s state stays with the training thread, so a dataset's
    own ``matmul`` or ``conv`` (a transform) keeps FP32; amp_patch's patches
    are process-wide and a forked worker inherits them, so without this the
    data would be computed in the half dtype. Both fetchers run in the thread
    that loads (the training thread when ``num_workers=0``, each worker's main
    thread otherwise), which is where ``disable_casts`` applies.
    """
    fetch = importlib.import_module("torch.utils.data._utils.fetch")
    items: List[PatchItem] = []
    for name in ("_MapDatasetFetcher", "_IterableDatasetFetcher"):
        cls = getattr(fetch, name, None)
        if cls is None or not callable(getattr(cls, "fetch", None)):
            log.debug("amp_patch: torch.utils.data._utils.fetch.%s.fetch not found; its loads are cast", name)
            continue
        items.append((cls, "fetch", _uncast))
    return items


def _uncast(original: Callable) -> Callable:
    @functools.wraps(original)
    def fetch(*args: object, **kwargs: object) -> object:
        push_disabled()
        try:
            return original(*args, **kwargs)
        finally:
            pop_disabled()

    return fetch
