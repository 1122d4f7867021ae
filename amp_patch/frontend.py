"""The public front door: ``initialize``, ``deinitialize``, ``disable_casts``
and the registration functions.

``initialize`` builds the call's settings (``config.parse``) and a plan that
checks everything first (opt level, options, op lists, models, optimizers)
and changes nothing, then applies it in a fixed order: model conversion,
optimizer attachment (master weights, loss scaling), function patches. If any
step fails, what was done is undone before the error propagates, so torch is
never left half-patched (``run.plan``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional

import torch

import wrapt

from . import oplists
from .base import running
from .base.errors import ConfigError, StateError
from .patching.cast import cast
from .patching.wrappers import make_planner, pop_disabled, push_disabled, switch
from .precision import optimizers as optimizers_side
from .run import plan as plans
from .run.plan import Given, Plan, Registration
from .scaling import optimizer as optimizer_scaling

_lock = threading.RLock()


# User registrations (register_*_function): (owner, name, policy), applied at
# every initialize that patches functions, and at once if one is running.
_user_registrations: List[Registration] = []


def initialize(
    models: object,
    optimizers: object = None,
    opt_level: str = "O1",
    *,
    half_dtype: object = None,
    lists: object = None,
    verbosity: Optional[int] = None,
    **overrides: object,
) -> object:
    """Enable mixed precision for existing models and optimizers.

    Args:
        models: an ``nn.Module`` or a list of them (``None`` is allowed at
            O1/O4, where nothing about the model changes).
        optimizers: a ``torch.optim.Optimizer``, a list of them, or ``None``.
        opt_level: ``"O0"`` (FP32) ... ``"O5"``, with apex.amp's meanings;
            O4/O5 are the BF16 forms of O1/O2. ``"O6"`` is O5 with the
            model's ``nn.Linear`` GEMMs in FP8 (torchao's float8 training,
            the ``fp8`` extra), ``"O7"`` O6 with Adam's moments in FP8/BF16
            (MS-AMP's O1 and O2; ``amp_patch.precision.fp8``).
        half_dtype: ``torch.float16`` / ``torch.bfloat16`` (or their names);
            default ``$AMP_PATCH_HALF_DTYPE``, else FP16 for a CUDA model
            and BF16 for a CPU model.
        lists: op-list overrides: a YAML path, a dict, or a list of them
            (``$AMP_PATCH_LISTS`` adds more).
        verbosity: 0 silences amp_patch's informational messages (default 1).
        **overrides: the options of ``amp_patch.config.AmpConfig`` (every
            name in ``amp_patch.config.OPTIONS``; ``amp_patch.config.parse``
            checks them):

            - apex.amp's property overrides: ``cast_model_type``,
              ``patch_torch_functions``, ``keep_batchnorm_fp32``,
              ``master_weights``, ``loss_scale`` (``"dynamic"`` or a number),
              ``cast_model_outputs``;
            - the loss scaler: ``num_losses``, ``init_scale``,
              ``growth_factor``, ``backoff_factor``, ``growth_interval``,
              ``hysteresis``, ``min_loss_scale``, ``max_loss_scale``,
              ``max_consecutive_skips``;
            - the session: ``collect_stats`` (the op ledger),
              ``find_overflow`` (overflow provenance), ``cast_policy``
              (``"parity"``, autocast's casts, the default; ``"auto"``:
              matmuls too small for the half dtype to win stay FP32, see
              ``amp_patch.patching.costs``), ``sync_free`` (default
              True: the loss scale and the overflow verdict stay on the
              device and a step makes no host sync where its update can
              take the verdict; False: one host sync per step, as before);
            - this call's models and optimizers: ``keep_fp32`` (module-name
              patterns or a filter kept FP32 at O2/O3/O5), ``save_dtype``
              (the dtype ``state_dict()`` saves), ``fused_update`` (O2/O5:
              the compiled one-pass step where the default one-pass C step,
              ``amp_patch.precision.onepass``, cannot go), ``model_grads``
              (O2/O5, default True: after a backward each model parameter's
              ``.grad`` reads its true gradient in the half dtype, and edits
              there reach the step; False moves half gradients into the FP32
              masters as autograd finishes them and leaves the model's
              ``.grad`` None, which saves their memory), ``enabled``
              (apex.amp's: False hands everything back unchanged),
              ``allow_half_params`` (O1/O4: step FP16/BF16 parameters as
              they are), ``fp8_layers`` (O6/O7: which ``nn.Linear`` layers
              compute in FP8: ``"auto"``, the default, the shapes that gain
              with the first and last layers kept in BF16; ``"all"``;
              module-name patterns; or a filter ``(module, name) -> bool``);
            - O6/O7's session: ``fp8_recipe`` (``"tensorwise"``, the
              default, or ``"rowwise"``: torchao's FP8 scaling recipes).

            The first ``initialize`` sets the session's options; a later
            one that names another value is refused.

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
    return _start(models, optimizers, opt_level=opt_level, half_dtype=half_dtype, lists=lists,
                  verbosity=verbosity, options=overrides, apex_rules=False)


def initialize_as_apex(models: object, optimizers: object, *, opt_level: object, half_dtype: object = None,
                       lists: object = None, verbosity: Optional[int] = None, options: Optional[dict] = None) -> object:
    """``initialize`` under Apex's rule for a running session, for the Apex
    entry points (``apex.amp.initialize``, ``amp.init``): a later call with
    the running settings joins the run and restarts its loss scalers; one with
    other settings ends it, with a warning, once every check has passed."""
    return _start(models, optimizers, opt_level=opt_level, half_dtype=half_dtype, lists=lists,
                  verbosity=verbosity, options=options or {}, apex_rules=True)


def _start(models: object, optimizers: object, *, opt_level: object, half_dtype: object, lists: object,
           verbosity: Optional[int], options: dict, apex_rules: bool) -> object:
    """Build the call's plan and apply it, under the lock; a running session
    changes only between other threads' forwards, backwards and steps."""
    with _lock:
        amp = running.session()
        held = amp.flight.hold("amp.initialize()" if apex_rules else "amp_patch.initialize()") if amp is not None \
            else contextlib.nullcontext()
        with held:
            given = Given.of(models, optimizers)
            config = plans.configure(given, amp, opt_level=opt_level, half_dtype=half_dtype, lists=lists,
                                     verbosity=verbosity, **options)
            plan = Plan.build(given, config, amp, apex_rules=apex_rules, registrations=list(_user_registrations))
            return plan.apply()


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
    ``amp_patch.base.inflight``). Gradients a scaled backward left for a step that
    has not run yet are unscaled, or dropped when they overflowed, so the
    plain ``optimizer.step()`` that follows applies true gradients.

    Raises:
        StateError: when called inside an open ``scale_loss`` block, from a
            hook inside a forward, backward or step amp_patch runs, or when
            another thread's work does not finish within
            ``amp_patch.base.inflight.WAIT_SECONDS``; nothing is changed.
    """
    with _lock:
        amp = running.session()
        if amp is None:
            return
        if amp.flight.inside("scale_loss"):
            raise StateError(
                "deinitialize() was called inside a `with amp_patch.scale_loss(...)` block; "
                "leave the block first (its exit unscales the gradients), then deinitialize."
            )
        with amp.flight.hold("amp_patch.deinitialize()"):
            plans.end(amp)


def is_initialized() -> bool:
    """True between ``initialize`` and ``deinitialize``."""
    return running.session() is not None


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


def _register(owner: object, name: str, policy: str) -> None:
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
    amp = running.session()
    if amp is not None and amp.config.patch_torch_functions:
        with _lock:
            if amp.patcher.is_patched(owner, name):
                raise StateError(
                    f"{name} is already patched by the running amp_patch; register functions before "
                    f"initialize, or deinitialize and initialize again"
                )
            amp.patch([plans.user_item(amp, owner, name, policy)])


def register_half_function(module: object, name: str) -> None:
    """Run ``module.name`` in the half dtype under O1/O4 (apex.amp's name).

    Call it before ``initialize``; called after, it patches at once.

    Example::

        amp_patch.register_half_function(my_extension, "fused_gemm")
    """
    _register(module, name, "half")


def register_float_function(module: object, name: str) -> None:
    """Run ``module.name`` in FP32 under O1/O4 (apex.amp's name)."""
    _register(module, name, "float")


def register_promote_function(module: object, name: str) -> None:
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
            amp = running.session()
            if amp is None or not amp.config.patch_torch_functions or switch.off:
                return wrapped(*args, **kwargs)
            to = make_planner(policy, amp.config.half_dtype)(args, kwargs)
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
        amp = running.session()
        if amp is None:
            raise StateError("amp_patch.adopt_optimizer needs amp_patch.initialize(model, optimizer, opt_level=...) first")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"adopt_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if amp.attached(optimizer):
            return optimizer
        # the first initialize's fused_update applies to an adopted optimizer; no models come with it
        config = amp.config.replace(keep_fp32=None)
        optimizers_side.validate([], [optimizer], config, amp.precision)
        mark = amp.undo.mark()
        try:
            built = optimizers_side.attach(amp.precision, [], [optimizer], {}, config)
            optimizer_scaling.attach(amp.scaling, amp.undo, [optimizer], built)
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
