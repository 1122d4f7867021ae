"""The public front door: ``initialize``, ``deinitialize``, ``disable_casts``
and the registration functions.

``initialize`` validates everything first (opt level, options, op lists,
models, optimizers), then changes things in a fixed order: model conversion,
optimizer attachment (master weights, loss scaling), function patches. If any
step fails, what was done is undone before the error propagates, so torch is
never left half-patched.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib
import logging
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

import wrapt

from . import diagnostics, inflight, oplists, session
from .diagnostics.report import report_of
from .diagnostics.stats import Ledger
from .errors import ConfigError, StateError
from .oplists import NAMESPACES
from .options import Options
from .patching import costs
from .patching.cast import cast
from .patching.wrappers import make_planner, make_wrapper, pop_disabled, push_disabled, switch
from .precision import model as model_side
from .precision import optimizers as optimizers_side
from .properties import EXTRA_OPTIONS, Properties, resolve
from .scaling import optimizer as optimizer_scaling
from .scaling import state as scaling_state
from .scaling import validate_options
from .scaling.checkpoint import counters_of
from .session import Session

log = logging.getLogger("amp_patch")
_lock = threading.RLock()


# User registrations (register_*_function): (owner, name, policy), applied at
# every initialize that patches functions, and at once if one is running.
_user_registrations: List[Tuple[Any, str, str]] = []


def _as_list(obj: Any, kind: type, what: str) -> Tuple[List[Any], bool]:
    if obj is None:
        return [], False
    if isinstance(obj, (list, tuple)):
        items, was_list = list(obj), True
    else:
        items, was_list = [obj], False
    for i, x in enumerate(items):
        # an optimizer may come wrapped (Apex's LARC): the optimizer inside is attached
        if not (isinstance(x, kind) if kind is torch.nn.Module else optimizers_side.inner_optimizer(x) is not None):
            where = f"{what}[{i}]" if was_list else what
            raise ConfigError(
                f"{where} is a {type(x).__module__}.{type(x).__qualname__}; initialize expects "
                f"{'torch.nn.Module' if kind is torch.nn.Module else 'torch.optim.Optimizer'} "
                f"(or a list of them). Call amp_patch.initialize(model, optimizer, opt_level=...)."
            )
    return items, was_list


def _device_type(models: Sequence[torch.nn.Module]) -> str:
    for m in models:
        for t in list(m.parameters()) + list(m.buffers()):
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_models(models: Sequence[torch.nn.Module], props: Properties) -> None:
    for i, m in enumerate(models):
        tensors = list(m.parameters()) + list(m.buffers())
        if any(t.device.type == "meta" for t in tensors):
            raise ConfigError(
                f"model {i} ({type(m).__name__}) has tensors on the meta device. Materialize it first "
                f"(model.to_empty(device='cpu') and load its weights), then call initialize."
            )
        if props.cast_model_type is not None and not any(p.is_floating_point() for p in m.parameters()):
            raise ConfigError(
                f"model {i} ({type(m).__name__}) has no floating-point parameters, so opt_level="
                f"{props.opt_level!r} has nothing to cast. Use O1/O4 (function patching) or pass the model that holds the weights."
            )


def _patch_items(amp: Session) -> list:
    """(owner, name, make_wrapper) for every op in force, plus user registrations."""
    items = []
    for (ns, name), e in sorted(amp.table.items()):
        items.append((NAMESPACES[ns], name, _maker(e.policy, e.qualname, ns == "torch.Tensor", amp, e.fix)))
    for owner, name, policy in _user_registrations:
        items.append(_user_item(owner, name, policy, amp))
    return items


def _dataloader_items() -> list:
    """Patch items that run a DataLoader's fetch (dataset and collate) with casting off.

    ``torch.autocast``'s state stays with the training thread, so a dataset's
    own ``matmul`` or ``conv`` (a transform) keeps FP32; amp_patch's patches
    are process-wide and a forked worker inherits them, so without this the
    data would be computed in the half dtype. Both fetchers run in the thread
    that loads (the training thread when ``num_workers=0``, each worker's main
    thread otherwise), which is where ``disable_casts`` applies.
    """
    fetch = importlib.import_module("torch.utils.data._utils.fetch")
    items = []
    for name in ("_MapDatasetFetcher", "_IterableDatasetFetcher"):
        cls = getattr(fetch, name, None)
        if cls is None or not callable(getattr(cls, "fetch", None)):
            log.debug("amp_patch: torch.utils.data._utils.fetch.%s.fetch not found; its loads are cast", name)
            continue
        items.append((cls, "fetch", _uncast))
    return items


def _uncast(original: Callable) -> Callable:
    @functools.wraps(original)
    def fetch(*args, **kwargs):
        push_disabled()
        try:
            return original(*args, **kwargs)
        finally:
            pop_disabled()

    return fetch


def _user_item(owner: Any, name: str, policy: str, amp: Session) -> tuple:
    """The patch item for a register_*_function registration."""
    qual = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    return (owner, name, _maker(policy, qual, isinstance(owner, type), amp, ""))


def _maker(policy: str, qualname: str, method: bool, amp: Session, fix: str) -> Callable:
    def make(original):
        return make_wrapper(
            policy, qualname, original, method=method, half=amp.props.half_dtype,
            cache=amp.cache, ledger=amp.ledger, fix=fix, live=amp.live, min_flops=amp.min_flops,
        )

    return make


def initialize(
    models: Any,
    optimizers: Any = None,
    opt_level: str = "O1",
    *,
    half_dtype: Any = None,
    lists: Any = None,
    verbosity: Optional[int] = None,
    **overrides: Any,
) -> Any:
    """Enable mixed precision for existing models and optimizers.

    Args:
        models: an ``nn.Module`` or a list of them (``None`` is allowed at
            O1/O4, where nothing about the model changes).
        optimizers: a ``torch.optim.Optimizer``, a list of them, or ``None``.
        opt_level: ``"O0"`` (FP32) ... ``"O5"``, with apex.amp's meanings;
            O4/O5 are the BF16 forms of O1/O2.
        half_dtype: ``torch.float16`` / ``torch.bfloat16`` (or their names);
            default FP16 for a CUDA model and BF16 for a CPU model.
        lists: op-list overrides: a YAML path, a dict, or a list of them
            (``$AMP_PATCH_LISTS`` adds more).
        verbosity: 0 silences amp_patch's informational messages (default 1).
        **overrides: apex.amp property overrides (``cast_model_type``,
            ``patch_torch_functions``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``loss_scale``, ``cast_model_outputs``) and the
            options in ``EXTRA_OPTIONS`` (loss scaler settings, ``keep_fp32``,
            ``collect_stats``, ``find_overflow``, ``fused_update`` (O2/O5:
            the compiled one-pass step where the default one-pass C step,
            ``amp_patch.precision.kernel``, cannot go), ``cast_policy``
            (``"parity"``, autocast's casts, the default; ``"auto"``: matmuls
            too small for the half dtype to win stay FP32, see
            ``amp_patch.patching.costs``), ...).

    Returns:
        ``(models, optimizers)`` in the structure they were given, or just the
        models when ``optimizers`` is None.

    Raises:
        ConfigError: bad opt level, option, model or optimizer; nothing changed.
        ListError: invalid op lists; nothing changed.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O1")
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()        # scaled and unscaled for you
            optimizer.step()       # skipped when gradients overflowed
        amp_patch.deinitialize()   # torch exactly as before
    """
    return enter(models, optimizers, opt_level, half_dtype, lists, verbosity, overrides)


def enter(models, optimizers, opt_level, half_dtype, lists, verbosity, overrides, apex_rules=False):
    """``initialize`` under the lock; ``apex_rules`` as in ``_initialize``."""
    with _lock:
        amp = session.current()
        if amp is None:
            return _initialize(models, optimizers, opt_level, half_dtype, lists, verbosity, overrides, apex_rules)
        # a running session changes only between other threads' forwards, backwards and steps
        with amp.flight.hold("amp.initialize()" if apex_rules else "amp_patch.initialize()"):
            return _initialize(models, optimizers, opt_level, half_dtype, lists, verbosity, overrides, apex_rules)


def _initialize(models, optimizers, opt_level, half_dtype, lists, verbosity, overrides, apex_rules=False):
    """``initialize``'s work. ``apex_rules``: the call comes through ``amp.initialize``,
    where Apex's "last call wins" replaces the strict rule for a running session
    (see ``_apex_rerun``)."""
    model_list, models_were_list = _as_list(models, torch.nn.Module, "models")
    opt_list, opts_were_list = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    inner_opts = [optimizers_side.inner_optimizer(o) for o in opt_list]
    wrappers = [o for o, inner in zip(opt_list, inner_opts) if o is not inner]
    # What the launcher (or amp_patch.auto) started is provisional: a script's
    # own initialize replaces it, keeping the launcher's half dtype and op
    # lists unless this call names its own, so nothing is patched twice. It is
    # torn down only once this call has passed every check, so a bad call
    # leaves the launcher's session running.
    lists_given = lists is not None
    running = session.current()
    prov = running if running is not None and running.provisional is not None else None
    if prov is not None:
        running = None
        given = prov.provisional
        half_dtype = given.half_dtype if half_dtype is None else half_dtype
        lists = given.lists if lists is None else lists
        if overrides.get("cast_model_outputs") is None and given.cast_model_outputs is not None:
            overrides["cast_model_outputs"] = given.cast_model_outputs
    options = Options.build(verbosity=verbosity, **{k: overrides.pop(k) for k in list(overrides) if k in EXTRA_OPTIONS})
    device_type = _device_type(model_list)
    props = resolve(opt_level, device_type, half_dtype, **overrides)
    if not options.enabled:
        # apex.amp's enabled=False: everything as it was, the models and optimizers handed back
        if prov is not None:
            prov.end()
        return _returned(models, model_list, models_were_list, optimizers, opt_list, opts_were_list)
    if props.cast_model_type is not None and not model_list:
        raise ConfigError(f"opt_level={props.opt_level!r} casts the model, so initialize needs the model (got none)")
    _check_models(model_list, props)
    if lists_given and not props.patch_torch_functions:
        raise ConfigError(
            f"lists= overrides the op lists, but opt_level={props.opt_level!r} patches no functions (it casts the "
            f"model instead), so they would do nothing. Use O1 or O4 for op lists, or drop lists="
        )
    table = oplists.load(lists).resolve(props.half_dtype, device_type) if props.patch_torch_functions else None
    validate_options(props, options)
    replaced = None
    if apex_rules and running is not None:
        running, replaced, new_models, new_opts = _apex_rerun(running, props, lists, model_list, inner_opts)
    else:
        new_models, new_opts = model_list, inner_opts
    model_side.validate(new_models, props, options)
    optimizers_side.validate(new_models, new_opts, props, options, running, replacing=prov)

    if replaced is not None:
        # every check passed: only now does the earlier run end
        diagnostics.warn_user(_farewell(replaced, props))
        _end(replaced)
    amp = running
    fresh = amp is None
    # under Apex's rule a later call joins the run as _apex_rerun decided; else the strict checks
    if not fresh and not apex_rules:
        if amp.props != props:
            raise ConfigError(
                f"amp_patch is already initialized with opt_level={amp.props.opt_level!r}, "
                f"half_dtype={amp.props.half_dtype}; this call asks for opt_level={props.opt_level!r}, "
                f"half_dtype={props.half_dtype}. Use the same settings for every model, or call "
                f"amp_patch.deinitialize() first."
            )
        if lists is not None:
            raise ConfigError("lists= can only be given to the first initialize; call amp_patch.deinitialize() to change the op lists")
        clash = [m for m in model_list if amp.holds(m)]
        if clash:
            raise ConfigError(f"model {type(clash[0]).__name__} is already initialized; pass each model to initialize once")
        differ = options.differences(amp.options)
        if differ:
            raise ConfigError(
                f"initialize: {', '.join(differ)}: these options belong to the whole session and the first "
                f"initialize set them. Leave them out of this call (or pass the running values), or call "
                f"amp_patch.deinitialize() and initialize everything in one call."
            )
    elif fresh:
        if prov is not None:
            prov.end()
        amp = Session(props, table, device_type, options)
        if options.collect_stats:
            amp.ledger = Ledger()
        if options.cast_policy == "auto" and props.patch_torch_functions:
            amp.min_flops = costs.threshold(props.half_dtype, device_type, torch.get_num_threads())

    mark = amp.undo.mark()
    try:
        if fresh:
            session.set_current(amp)
        elif apex_rules:
            scaling_state.restart(amp, options)
            if props.patch_torch_functions and not len(amp.patcher):
                # _amp_state.handle._deactivate() took the patches off; Apex's
                # next amp.initialize patched again, and so does this one
                amp.patch(_patch_items(amp) + _dataloader_items())
        originals = model_side.attach(amp, new_models, options)
        built = optimizers_side.attach(amp, new_models, new_opts, originals, options)
        inflight.watch(amp, new_models)
        optimizer_scaling.attach(amp, new_opts, built)
        optimizer_scaling.attach_wrappers(amp, [w for w in wrappers if any(w.optim is o for o in new_opts)])
        amp.extend(amp.models, new_models)
        amp.extend(amp.optimizers, new_opts)
        if fresh:
            if props.patch_torch_functions:
                amp.patch(_patch_items(amp) + _dataloader_items())
                if amp.ledger is not None:
                    amp.ledger.start(amp)
            if options.find_overflow:
                diagnostics.arm_find_overflow(amp)
    except BaseException:
        # the first call ends the session it started; a later one pops back to
        # where it started: its models unconverted, its optimizers as they were
        if fresh:
            amp.end()
        else:
            amp.undo.pop_to(mark)
        raise
    if fresh and options.verbosity:
        log.info("amp_patch: initialized %s with %s", props.opt_level, props.half_dtype)
        diagnostics.warn_at_initialize(amp, new_models, new_opts)

    return _returned(models, model_list, models_were_list, optimizers, opt_list, opts_were_list)


def _farewell(old: Session, props: Properties) -> str:
    """What an ``amp.initialize`` with other settings does to the run it ends, in one warning."""
    was = old.props
    lost = []
    if was.cast_model_type in (torch.float16, torch.bfloat16):
        lost.append(f"its {len(old.models)} model(s) are FP32 again")
    if was.patch_torch_functions:
        lost.append("torch functions are no longer cast for them")
    if old.optimizers:
        lost.append(f"its {len(old.optimizers)} optimizer(s) are plain torch optimizers again (no loss scaling, no masters)")
    lost.append("the loss scalers start anew")
    return (
        f"amp.initialize(opt_level={props.opt_level!r}, half dtype {props.half_dtype}) replaced the running "
        f"{was.opt_level} ({was.half_dtype}) run: as in Apex, the last call sets the properties and the loss "
        f"scalers anew. Of the earlier run, {'; '.join(lost)}. To keep every model mixed, initialize them all "
        f"in one call: amp.initialize([model1, model2], [opt1, opt2], opt_level=...)"
    )


def _apex_rerun(running: Session, props: Properties, lists: Any, models: List[Any], opts: List[Any]):
    """Apex's rule for another ``amp.initialize`` while a run is on.

    Apex set its properties and loss scalers anew at every call and left the
    earlier models as they were. Here a call with the running settings joins
    the run (the models and optimizers it already holds stay as they are, the
    loss scalers restart with this call's settings, ``scaling.state.restart``);
    a call with other settings ends the earlier run, once every check of the
    new one has passed, and says so.

    Returns:
        ``(session to join or None, session to end or None, models to attach, optimizers to attach)``.
    """
    if running.props != props or lists is not None:
        return None, running, models, opts
    return running, None, [m for m in models if not running.holds(m)], [o for o in opts if not running.attached(o)]


def _returned(models, model_list, models_were_list, optimizers, opt_list, opts_were_list):
    """``initialize``'s result: what it was given, in the structure it was given."""
    out_models = model_list if models_were_list else (model_list[0] if model_list else models)
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_were_list else opt_list[0])


def deinitialize() -> None:
    """Undo ``initialize``: torch, the models and the optimizers as they were.

    Every patched attribute is restored in reverse order, so ``vars()`` of each
    namespace in ``oplists.NAMESPACES`` (``torch``, ``torch.nn.functional``,
    ``torch.Tensor``, ``torch.linalg``, ``torch.special``, ``torch.fft``,
    ``torch._VF``) holds exactly the objects it held before. An O2 model goes
    back to FP32 holding the master values, and its optimizer to its own
    parameters. A no-op when nothing is initialized.

    Safe to call from another thread while one trains: it waits until no
    forward, backward or step amp_patch runs is in flight (see
    ``amp_patch.inflight``). Gradients a scaled backward left for a step that
    has not run yet are unscaled, or dropped when they overflowed, so the
    plain ``optimizer.step()`` that follows applies true gradients.

    Raises:
        StateError: when called inside an open ``scale_loss`` block, from a
            hook inside a forward, backward or step amp_patch runs, or when
            another thread's work does not finish within
            ``inflight.WAIT_SECONDS``; nothing is changed.
    """
    with _lock:
        amp = session.current()
        if amp is None:
            return
        if amp.flight.inside("scale_loss"):
            raise StateError(
                "deinitialize() was called inside a `with amp_patch.scale_loss(...)` block; "
                "leave the block first (its exit unscales the gradients), then deinitialize."
            )
        with amp.flight.hold("amp_patch.deinitialize()"):
            _end(amp)


def _end(amp: Session) -> None:
    """End a session: gradients a scaled backward left made true (or dropped),
    its figures kept for ``counters()`` and ``report()``, then every change undone."""
    try:
        scaling_state.settle(amp)
        patched = collections.Counter(entry.policy for entry in (amp.table or {}).values())
        session.set_ended(session.Ended(counters_of(amp), report_of(amp), dict(patched)))
    finally:
        amp.end()


def is_initialized() -> bool:
    """True between ``initialize`` and ``deinitialize``."""
    return session.current() is not None


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turn amp_patch's casting off inside the block, for this thread only.

    Nestable and exception-safe. Ops run in the dtypes of their inputs, and a
    ``loss.backward()`` inside it is not loss-scaled.

    Example::

        with amp_patch.disable_casts():
            p = torch.sigmoid(logits.float())
            loss = F.binary_cross_entropy(p, target)   # banned op, run in FP32
    """
    push_disabled()
    try:
        yield
    finally:
        pop_disabled()


def _register(owner: Any, name: str, policy: str) -> None:
    if not hasattr(owner, name):
        raise ConfigError(f"{getattr(owner, '__name__', owner)!r} has no attribute {name!r}; register_{policy}_function needs an existing function")
    if not callable(getattr(owner, name)):
        raise ConfigError(f"{getattr(owner, '__name__', owner)}.{name} is not callable")
    why = oplists.not_an_op(owner, name)
    if why is not None:
        raise ConfigError(
            f"{getattr(owner, '__name__', owner)}.{name} {why}, not a tensor op; register_{policy}_function "
            f"wraps functions that compute on tensors"
        )
    for i, (o, n, _) in enumerate(_user_registrations):
        if o is owner and n == name:
            _user_registrations[i] = (owner, name, policy)
            break
    else:
        _user_registrations.append((owner, name, policy))
    amp = session.current()
    if amp is not None and amp.props.patch_torch_functions:
        with _lock:
            if amp.patcher.is_patched(owner, name):
                raise StateError(
                    f"{name} is already patched by the running amp_patch; register functions before "
                    f"initialize, or deinitialize and initialize again"
                )
            amp.patch([_user_item(owner, name, policy, amp)])


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the half dtype under O1/O4 (apex.amp's name).

    Call it before ``initialize``; called after, it patches at once.

    Example::

        amp_patch.register_half_function(my_extension, "fused_gemm")
    """
    _register(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in FP32 under O1/O4 (apex.amp's name)."""
    _register(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest input dtype under O1/O4 (apex.amp's name)."""
    _register(module, name, "promote")




class DecoratorPolicy:
    """Backs ``half_function`` / ``float_function`` / ``promote_function``.

    A user's own function is wrapped once at decoration time and consults the
    running AMP state on every call: outside ``initialize`` it calls straight
    through, so decorating at import time is safe.
    """

    def __init__(self, policy: str):
        self.policy = policy

    def __call__(self, fn: Callable) -> Callable:
        policy = self.policy

        @wrapt.decorator
        def wrapper(wrapped, instance, args, kwargs):
            amp = session.current()
            if amp is None or not amp.props.patch_torch_functions or switch.off:
                return wrapped(*args, **kwargs)
            to = make_planner(policy, amp.props.half_dtype)(args, kwargs)
            if to is None:
                return wrapped(*args, **kwargs)
            return wrapped(*cast(args, to, amp.cache), **cast(kwargs, to, amp.cache))

        return wrapper(fn)


def adopt_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Attach an optimizer created after ``initialize``: loss scaling, and FP32
    masters under O2/O5. A no-op for an optimizer already attached.

    Args:
        optimizer: the new optimizer; under O2/O5 its parameters must belong
            to the models passed to ``initialize``.

    Returns:
        ``optimizer``, now patched like those passed to ``initialize``.

    Raises:
        StateError: before ``initialize``.
        ConfigError: the optimizer does not fit the opt level (e.g. FP16
            weights at O1, foreign parameters at O2); nothing changed.

    Example::

        model = amp_patch.initialize(model, opt_level="O1")
        optimizer = amp_patch.adopt_optimizer(torch.optim.AdamW(model.parameters()))
    """
    with _lock:
        amp = session.current()
        if amp is None:
            raise StateError("amp_patch.adopt_optimizer needs amp_patch.initialize(model, optimizer, opt_level=...) first")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"adopt_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if amp.attached(optimizer):
            return optimizer
        # the first initialize's fused_update applies to an adopted optimizer; no models come with it
        options = dataclasses.replace(amp.options, keep_fp32=None)
        optimizers_side.validate([], [optimizer], amp.props, options, amp)
        mark = amp.undo.mark()
        try:
            built = optimizers_side.attach(amp, [], [optimizer], {}, options)
            optimizer_scaling.attach(amp, [optimizer], built)
            amp.extend(amp.optimizers, [optimizer])
        except BaseException:
            amp.undo.pop_to(mark)
            raise
        return optimizer


half_function = DecoratorPolicy("half")
half_function.__doc__ = "Decorator: run a user function in the half dtype while O1/O4 is active."
float_function = DecoratorPolicy("float")
float_function.__doc__ = "Decorator: run a user function in FP32 while O1/O4 is active."
promote_function = DecoratorPolicy("promote")
promote_function.__doc__ = "Decorator: run a user function in the widest input dtype while O1/O4 is active."
