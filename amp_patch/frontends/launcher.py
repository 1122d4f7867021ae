"""The zero-code launcher: run an unmodified training script with AMP on.

``amp-patch run [options] script.py [args...]`` (and ``import amp_patch.auto``)
enable mixed precision before the script imports anything:

* **O1/O4** patch torch's functions up front, and every optimizer the script
  builds is handed to the loss scaler as soon as its constructor returns, so a
  plain FP32 loop (``loss.backward(); optimizer.step()``) trains in mixed
  precision unchanged.
* **O2/O3/O5** cast the model, so they need it: when the script builds an
  optimizer, the launcher finds the one ``nn.Module`` that holds all of that
  optimizer's parameters and initializes the pair. Each later optimizer is
  paired with its own model the same way. When no single model owns the
  parameters, the model is already wrapped in DistributedDataParallel, or the
  model is already paired, the optimizer's constructor raises a ``ConfigError``
  that says to add the one-line ``initialize`` instead.
* **O0** runs in FP32; only the apex alias is installed.

What the launcher starts is *provisional*: if the script calls
``amp.initialize`` / ``amp_patch.initialize`` itself, its call replaces the
launcher's (keeping the launcher's half dtype and op lists unless the call
names its own) and the launcher steps aside for the rest of the run.

Every switch is also an environment variable, for launchers that cannot pass
flags (``torchrun``): ``AMP_PATCH_OPT_LEVEL``, ``AMP_PATCH_HALF_DTYPE``,
``AMP_PATCH_LOSS_SCALE``, ``AMP_PATCH_OUTPUTS`` and ``AMP_PATCH_LISTS``; a flag beats its variable.

``run`` can say what it did (``amp-patch run`` does, on stderr, unless
``--quiet``): ``banner`` before the script, with where each setting came from,
and ``summary`` after it, from the last run's figures (``running.last_ended()``).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import runpy
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple, Union

import torch
import wrapt
from torch.nn.modules.module import register_module_forward_pre_hook

from .. import diagnostics, frontend, oplists
from ..base import running
from ..base.errors import ConfigError
from ..patching import jit
from ..patching.registry import Patcher
from ..precision import model as model_side
from ..diagnostics.stats import dtype_name
from ..base.undo import Owned
from ..config import (ENV_HALF_DTYPE, FUNCTION_LEVELS, MODEL_LEVELS, PRESETS, AmpConfig, parse, parse_dtype,
                      parse_level, parse_loss_scale)
from ..run.session import Provisional, Session
from . import alias, carry, scan
from .outputs import OutermostOutputs

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

log = logging.getLogger("amp_patch")

ENV_OPT_LEVEL = "AMP_PATCH_OPT_LEVEL"
ENV_LOSS_SCALE = "AMP_PATCH_LOSS_SCALE"
ENV_OUTPUTS = "AMP_PATCH_OUTPUTS"
OUTPUT_CHOICES = ("float32", "half")
ENV_LISTS = oplists.ENV_VAR  # read by oplists itself, wherever lists are loaded

_NOTSET = object()


@dataclasses.dataclass(frozen=True)
class Settings:
    """The launcher's validated switches.

    ``lists`` holds only the explicitly given override files; ``$AMP_PATCH_LISTS``
    is added by the op-list loader wherever lists are loaded.
    """

    opt_level: str = "O1"
    half_dtype: Optional[torch.dtype] = None
    loss_scale: Union[str, float, None] = None
    lists: Tuple[str, ...] = ()
    #: "float32": the models' floating outputs come back in FP32 (Apex's
    #: cast_model_outputs), so code written for FP32 (numpy, which has no
    #: bfloat16) keeps working; "half": as the model computed them
    outputs: str = "float32"
    #: where each setting came from: its flag (``--opt-level``), its environment
    #: variable, the argument of ``resolve`` that gave it, or "default"
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(
        cls,
        opt_level: Optional[str] = None,
        half_dtype: object = None,
        loss_scale: object = None,
        lists: Sequence[str] = (),
        names: Optional[dict] = None,
        outputs: Optional[str] = None,
    ) -> "Settings":
        """Validate explicit values, falling back to the environment variables.

        Args:
            opt_level, half_dtype, loss_scale, lists, outputs: explicit values
                (None: take the environment variable, then the default).
            names: how to name each explicit input in error messages, e.g.
                ``{"opt_level": "--opt-level"}``.

        Raises:
            ConfigError: a bad value, naming the flag or variable it came from.
            ListError: every problem in the op lists (including ``$AMP_PATCH_LISTS``).

        Example::

            settings = Settings.resolve(opt_level="O1", half_dtype="bfloat16")
        """
        names = names or {}
        sources: Dict[str, str] = {}

        def pick(key: str, value: object, env: str) -> Tuple[object, str]:
            if value is not None:
                sources[key] = names.get(key, key)
                return value, sources[key]
            raw = os.environ.get(env, "").strip()
            sources[key] = env if raw else "default"
            return (raw or None), env

        raw, where = pick("opt_level", opt_level, ENV_OPT_LEVEL)
        level = "O1" if raw is None else parse_level(str(raw), where)

        half, where = pick("half_dtype", half_dtype, ENV_HALF_DTYPE)
        if half is not None:
            half = parse_dtype(half, where)

        scale, where = pick("loss_scale", loss_scale, ENV_LOSS_SCALE)
        if scale is not None:
            scale = parse_loss_scale(scale, where)

        out, where = pick("outputs", outputs, ENV_OUTPUTS)
        out = "float32" if out is None else str(out).strip().lower()
        if out not in OUTPUT_CHOICES:
            raise ConfigError(f"{where}={out!r} is not an output choice; use float32 (the default) or half")

        given = tuple(str(p) for p in lists)
        sources["lists"] = names.get("lists", "lists")
        settings = cls(level, half, scale, given, out, sources)
        settings.config()  # combinations (e.g. O4 with float16)
        if level != "O0" or given:
            oplists.load(list(given))  # every list problem now, before the script starts
        return settings

    def initialize_kwargs(self) -> dict:
        """The keyword arguments these settings give ``amp_patch.initialize``."""
        out: dict = {"half_dtype": self.half_dtype, "lists": list(self.lists) or None}
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        if self.output_dtype is not None:
            out["cast_model_outputs"] = self.output_dtype
        return out

    def config(self) -> AmpConfig:
        """What these settings resolve to on this machine (the half dtype and loss scale chosen)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return parse(self.opt_level, device, half_dtype=self.half_dtype, loss_scale=self.loss_scale,
                     names=self.sources)

    @property
    def output_dtype(self) -> Optional[torch.dtype]:
        """The dtype the models' outputs are cast to, or None to keep what they computed."""
        return torch.float32 if self.outputs == "float32" and self.opt_level != "O0" else None


# ------------------------------------------------------------------ optimizers


class OptimizerHook:
    """Calls ``on_built(optimizer)`` when a script finishes building an optimizer.

    Optimizer subclasses do work after ``super().__init__()`` returns, so the
    hook wraps ``__init__`` of ``Optimizer`` and of every subclass (existing
    ones now, later ones as they are defined) and fires when the outermost
    constructor of an object returns. An optimizer built inside another one's
    constructor (a wrapper optimizer) is left to its owner.
    """

    def __init__(self, on_built: Callable[[torch.optim.Optimizer], None]):
        self.on_built = on_built
        self._patcher = Patcher(Owned(self))
        self._building = threading.local()
        self._own_init_subclass: object = _NOTSET

    def install(self) -> None:
        """Start watching optimizer construction; undo with ``uninstall()``.

        Example::

            hook = OptimizerHook(lambda opt: print(type(opt).__name__))
            hook.install()
            try:
                torch.optim.SGD(model.parameters(), lr=0.1)   # prints "SGD"
            finally:
                hook.uninstall()
        """
        base = torch.optim.Optimizer
        hook = self

        def init_subclass(cls, **kwargs):
            super(base, cls).__init_subclass__(**kwargs)
            hook._wrap(cls)

        classes, todo = [], [base]
        while todo:
            cls = todo.pop()
            classes.append(cls)
            todo.extend(cls.__subclasses__())
        try:
            for cls in classes:
                self._wrap(cls)
        except BaseException:
            self._patcher.unpatch_all()
            raise
        # Not through the Patcher: the inherited value is a fresh bound method
        # on every lookup, so "is it back?" checks cannot work; own-or-delete can.
        self._own_init_subclass = vars(base).get("__init_subclass__", _NOTSET)
        base.__init_subclass__ = classmethod(init_subclass)

    def uninstall(self) -> None:
        """Put every ``__init__`` (and ``Optimizer.__init_subclass__``) back as it was."""
        base = torch.optim.Optimizer
        if self._own_init_subclass is not _NOTSET:
            base.__init_subclass__ = self._own_init_subclass
        elif "__init_subclass__" in vars(base):
            del base.__init_subclass__
        self._own_init_subclass = _NOTSET
        self._patcher.unpatch_all()

    def _wrap(self, cls: type) -> None:
        if "__init__" in vars(cls):
            self._patcher.apply([(cls, "__init__", lambda old: wrapt.FunctionWrapper(old, self._init))])

    def _init(self, wrapped, instance, args, kwargs):
        stack = self._building.__dict__.setdefault("stack", [])
        outermost = not stack
        stack.append(instance)
        try:
            wrapped(*args, **kwargs)
        finally:
            stack.pop()
        if outermost:
            self.on_built(instance)


def owning_model(optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """The one top-level ``nn.Module`` that holds every parameter of ``optimizer``.

    Looks through the live modules once; a module that is another module's
    child is not top-level.

    Raises:
        ConfigError: no such module, several, or one already wrapped in
            DistributedDataParallel; the message says to call ``initialize``.
    """
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # type(), not isinstance(): isinstance also asks o.__class__, which some
    # live objects (deprecated torch aliases, proxies) answer with warnings.
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    roots = [m for m in modules if id(m) not in children and wanted <= {id(p) for p in m.parameters()}]
    fix = (
        "add the one line `model, optimizer = amp_patch.initialize(model, optimizer, opt_level=...)` "
        "after building them (or run at --opt-level O1/O4, which needs no model)"
    )
    name = type(optimizer).__name__
    if not roots:
        raise ConfigError(
            f"the launcher cannot tell which model {name} trains: no single nn.Module holds all of its "
            f"parameters, and opt levels O2/O3/O5 must cast the model; {fix}"
        )
    if len(roots) > 1:
        kinds = ", ".join(type(m).__name__ for m in roots)
        raise ConfigError(f"the launcher cannot tell which model {name} trains: {len(roots)} models hold its parameters ({kinds}); {fix}")
    model = roots[0]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(
            f"the model of {name} is already wrapped in DistributedDataParallel, and O2/O3/O5 must cast a "
            f"model before DDP wraps it; add `model, optimizer = amp_patch.initialize(model, optimizer, "
            f"opt_level=...)` before `DistributedDataParallel(model)`, or run at --opt-level O1/O4"
        )
    return model


# --------------------------------------------------------------------- launch


def _end_session() -> None:
    frontend.deinitialize()


class Launch:
    """AMP for a whole process, started before the script and stopped after it.

    ``start()`` installs the apex alias and, by opt level, patches functions
    up front and hooks optimizer construction; ``stop()`` undoes all of it.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.amp: Optional[Session] = None  # the session this launch started, if any
        self.stepped_aside = False
        self.aside_why: Optional[str] = None  # what showed the script runs its own mixed precision
        #: what start() changed outside the session (alias, optimizer hook,
        #: forward hook): this launch's entries on the process's undo stack, which stop() unwinds
        self.undo = Owned(self)
        #: initialize's set-up warnings, held until the launcher's level runs
        #: (the first forward of any module, whose line they then point at),
        #: and dropped if the script's own initialize replaces that level first
        self._held: List[Tuple[str, type]] = []
        self._forward_hook: Optional["RemovableHandle"] = None  # global forward pre-hook that gives the held warnings
        #: for the summary: the figures of the last run ended before start(), to tell a new
        #: one from them, and whether the script's own initialize set the last run
        self._ended_before: Optional[running.Ended] = None
        self.by_script: Optional[bool] = None

    def start(self) -> None:
        """Turn AMP on. Raises ``ConfigError`` if amp_patch is already initialized.

        Example::

            launch = Launch(Settings.resolve(opt_level="O1"))
            launch.start()
            try:
                train()
            finally:
                launch.stop()
        """
        if running.session() is not None:
            raise ConfigError("amp_patch is already initialized in this process; the launcher starts it itself. Call amp_patch.deinitialize() first.")
        self._ended_before = running.last_ended()
        level = self.settings.opt_level
        try:
            if not alias.is_installed() and alias.install_apex_alias():
                self.undo.push(alias.remove_apex_alias)
            if level != "O0":
                # torch.jit.script of a model the launcher's hooks are on (the outermost call's,
                # the output casts) compiles without them; undone after any session, which may
                # have asked for the same (patching.jit)
                jit.hide_hooks_from_script(self.undo)
            # whichever session runs at the end (the launcher's or the script's) ends before the alias goes
            self.undo.push(_end_session)
            if level in FUNCTION_LEVELS:
                self._holding(frontend.initialize, None, None, level, **self.settings.initialize_kwargs())
                self._mark(running.session())
            if level in FUNCTION_LEVELS or level in MODEL_LEVELS:
                hook = OptimizerHook(self._on_optimizer)
                hook.install()
                self.undo.push(hook.uninstall)
                scalers = Patcher(Owned(self))
                scalers.apply([(torch.amp.GradScaler, "__init__",
                                lambda old: wrapt.FunctionWrapper(old, self._built_grad_scaler))])
                self.undo.push(scalers.unpatch_all)
            if self.settings.output_dtype is not None or level in FUNCTION_LEVELS:
                # models nobody paired (built after initialize, for evaluation) return FP32 too;
                # and, the models being unknown at O1/O4, each outermost module call starts
                # with an empty weight-cast cache (a `.data` write bumps no version counter)
                guard = OutermostOutputs(cast=self.settings.output_dtype is not None)
                guard.install()
                self.undo.push(guard.uninstall)
        except BaseException:
            self.stop()
            raise
        log.info("amp_patch: launcher started %s", level)

    def stop(self) -> None:
        """Undo ``start()``: no hook, no alias, amp_patch deinitialized."""
        self._release_held()
        current = running.session()
        self.by_script = (current is not self.amp) if current is not None else (self.amp is None)
        self.undo.pop_to(0)

    def figures(self) -> Optional[running.Ended]:
        """The figures of the mixed-precision run this launch saw, after ``stop()``; None if none ran."""
        figures = running.last_ended()
        if figures is self._ended_before or (self.aside_why is not None and not self.by_script):
            return None  # nothing ran, or only the launcher's run it ended on stepping aside
        return figures

    def no_run(self) -> Optional[str]:
        """Why no mixed precision ran, after ``stop()``; None if it did."""
        return no_run_reason(self.settings, self.aside_why) if self.figures() is None else None

    def summary(self) -> str:
        """What ran, after ``stop()``: see ``summary``."""
        return summary(self.settings, self.by_script, self.figures(), self.aside_why)

    def _mark(self, amp: Session) -> None:
        self.amp = amp
        kwargs = self.settings.initialize_kwargs()
        amp.provisional = Provisional(kwargs["half_dtype"], kwargs["lists"], self.settings.output_dtype)
        amp.undo.push(self._forget_held)

    def _forget_held(self) -> None:
        """When the launcher's session ends with set-up warnings still held (the
        script's own initialize replaces it, or the script deinitializes), they
        are dropped and forgotten there and then: the script's initialize, which
        runs its own checks next, then gives those that apply to its run (the
        same message included: FP16 on the CPU at the launcher's own level)."""
        held, self._held = self._held, []
        diagnostics.forget_warned([m for m, _ in held])

    def _ours(self) -> bool:
        """True while the running AMP state is the one this launch started."""
        current = running.session()
        if self.stepped_aside or (self.amp is not None and current is not self.amp) or (self.amp is None and current is not None):
            # The script initialized (or deinitialized) itself: its word wins,
            # and warnings about the launcher's level, which never ran, go.
            self.stepped_aside = True
            diagnostics.forget_warned([m for m, _ in self._held])
            self._held = []
            return False
        return True

    def _holding(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` holding back the warnings it gives, until the first forward of a module."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn(*args, **kwargs)
        self._held += [(str(w.message), w.category) for w in caught]
        if self._held and self._forward_hook is None:
            self._forward_hook = register_module_forward_pre_hook(self._first_forward)
            self.undo.push(self._drop_forward_hook)
        return out

    def _drop_forward_hook(self) -> None:
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def _first_forward(self, module: torch.nn.Module, args: tuple) -> None:
        self._drop_forward_hook()
        if self._ours():
            self._release_held()

    def _built_grad_scaler(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        self._on_grad_scaler(instance)

    def _step_aside(self, what: str) -> None:
        """The script runs its own mixed precision (``what`` shows it): the launcher's
        AMP goes, and the script runs as it was written."""
        log.info("amp_patch: the script runs its own mixed precision (%s); the launcher turns its own AMP off "
                 "and leaves the script as it is", what)
        self.stepped_aside = True
        self.aside_why = what
        if self.amp is not None and running.session() is self.amp:
            frontend.deinitialize()

    def _on_grad_scaler(self, scaler: Any) -> None:
        # torch.amp.GradScaler (torch.cuda.amp's too): the script scales its own
        # loss. A second scaler would scale it twice, and FP16 gradients of a loss
        # scaled by 2**32 overflow at every step, so nothing would train.
        if self._ours() and scaler.is_enabled():
            self._step_aside("torch.amp.GradScaler")

    def _carry(self, optimizer: torch.optim.Optimizer) -> None:
        """The loss scaler's state in ``optimizer``'s checkpoints (``carry``), until the launch stops."""
        self.undo.push(carry.Carry(optimizer))

    def _wrapped_attached(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.Optimizer]:
        """The attached optimizer ``optimizer`` wraps (holds as an attribute), or None."""
        amp = running.session()
        if amp is None:
            return None
        for value in vars(optimizer).values():
            if isinstance(value, torch.optim.Optimizer) and value is not optimizer and amp.handle_of(value) is not None:
                return value
        return None

    def _release_held(self) -> None:
        """Give the held set-up warnings, pointing at the script's line that runs now."""
        held, self._held = self._held, []
        if held and not self.stepped_aside and self.amp is not None and running.session() is self.amp:
            for message, category in held:
                diagnostics.warn_user(message, category)

    def _on_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._ours():
            return
        inner = self._wrapped_attached(optimizer)
        if inner is not None:
            # Accelerate's AcceleratedOptimizer (Hugging Face's Trainer builds one
            # around its AdamW): its step and zero_grad call the attached one's,
            # which take the step. Attached itself it would count every step
            # twice, and at O2 its param_groups are the inner one's FP32 masters,
            # which no model holds.
            log.info("amp_patch: %s wraps the attached %s; the launcher leaves it to call its step",
                     type(optimizer).__name__, type(inner).__name__)
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        converted = {id(p) for m in (self.amp.models if self.amp is not None else ()) for p in m.parameters()}
        if any(p.dtype in (torch.float16, torch.bfloat16) and id(p) not in converted for p in params):
            # model.half() + FP16_Optimizer (or a hand-written loop): the script
            # keeps its own masters and loss scale, which a second scaler would
            # double, and its half model was never meant to meet O1's casts.
            # It ran without apex.amp, so it runs without amp_patch's AMP too.
            self._step_aside(f"an optimizer over FP16/BF16 parameters, {type(optimizer).__name__}")
            return
        if self.settings.opt_level in FUNCTION_LEVELS:
            frontend.adopt_optimizer(optimizer)
            self._carry(optimizer)
            amp = running.session()
            if amp.config.cast_model_outputs is not None:
                try:
                    model = owning_model(optimizer)
                except ConfigError:
                    return  # no single model: nothing to cast the outputs of
                model_side.cast_outputs(amp.precision, model)
            return
        model = owning_model(optimizer)
        if self.amp is not None and self.amp.holds(model):
            raise ConfigError(
                f"the launcher already paired {type(model).__name__} with an earlier optimizer; a second optimizer "
                f"over the same model needs the one line `model, [opt1, opt2] = amp_patch.initialize(model, "
                f"[opt1, opt2], opt_level={self.settings.opt_level!r})` in the script"
            )
        # The launcher's own later calls add to its state instead of replacing it.
        saved = self.amp.provisional if self.amp is not None else None
        if self.amp is not None:
            self.amp.provisional = None
        try:
            self._holding(frontend.initialize, model, optimizer, self.settings.opt_level, **self.settings.initialize_kwargs())
        finally:
            if self.amp is not None:
                self.amp.provisional = saved
        if self.amp is None:
            self._mark(running.session())
        self._carry(optimizer)
        log.info("amp_patch: launcher attached %s to %s at %s", type(optimizer).__name__, type(model).__name__, self.settings.opt_level)


# ------------------------------------------------------------- what it says

PREFIX = "amp-patch run: "

def _from(source: str) -> str:
    return "default" if source == "default" else f"from {source}"


def _loss_scaling(props: AmpConfig, source: str) -> str:
    if props.dynamic:
        where = "the opt level's default" if source == "default" else _from(source)
        return f"dynamic loss scaling ({where})"
    if props.loss_scale == 1.0:
        why = ", bfloat16 needs none" if props.half_dtype == torch.bfloat16 else ""
        return f"no loss scaling (static 1.0{why})"
    return f"static loss scale {props.loss_scale:g} ({_from(source)})"


def banner(settings: Settings, script: Optional[str] = None) -> str:
    """The one line ``amp-patch run`` prints before the script starts: the opt
    level, half dtype and loss scaling in force, where each came from, and
    whether the script calls ``initialize`` itself (read from its source).

    Example::

        print(banner(Settings.resolve(opt_level="O2"), "train.py"), file=sys.stderr)
    """
    props, src = settings.config(), settings.sources
    level = settings.opt_level
    parts = [f"{level} ({_from(src.get('opt_level', 'default'))}; {PRESETS[level].does})"]
    if level != "O0":
        device = "CUDA" if torch.cuda.is_available() else "CPU"
        half_src = src.get("half_dtype", "default")
        parts.append(f"half dtype {dtype_name(props.half_dtype)} "
                     f"({_from(half_src) if half_src != 'default' else 'default on ' + device})")
        parts.append(_loss_scaling(props, src.get("loss_scale", "default")))
        if src.get("outputs", "default") != "default":
            parts.append(f"outputs {settings.outputs} ({_from(src['outputs'])})")
        lists = [f"{f} ({src.get('lists', 'lists')})" for f in settings.lists]
        lists += [f"{f} ({ENV_LISTS})" for f in os.environ.get(ENV_LISTS, "").split(os.pathsep) if f.strip()]
        if lists:
            parts.append("op lists + " + ", ".join(lists))
    line = PREFIX + ", ".join(parts)
    call = None
    if script is not None and os.path.isfile(script):
        try:
            with open(script, encoding="utf-8") as f:
                call = scan.initialize_call(f.read(), script)
        except (OSError, UnicodeDecodeError):
            call = None
    if call is not None:
        line += (f"; {os.path.basename(script)}:{call[0]} calls {call[1]} itself, and its opt level and loss "
                 f"scale replace these from there")
    return line


def no_run_reason(settings: Settings, aside: Optional[str]) -> str:
    """Why a launch ran no mixed precision (``summary``'s words; ``aside`` as there)."""
    if aside:
        return f"the script runs its own mixed precision ({aside}), so the launcher turned its AMP off"
    if settings.opt_level == "O0":
        return "nothing to do at O0"
    if settings.opt_level in MODEL_LEVELS:
        return "the script built no optimizer for the launcher to attach its model to"
    return "the script turned it off"


def summary(settings: Settings, by_script: Optional[bool], figures: Optional[running.Ended], aside: Optional[str]) -> str:
    """The line ``amp-patch run`` prints after the script: who set the run's
    settings, steps taken and skipped, the final loss scale, the ops cast.

    Args:
        by_script: True when the script's own ``initialize`` set the last run,
            False when the launcher did, None when no run was on at the end.
        figures: the last run's figures (``running.last_ended()``), None if none ran.
        aside: what showed that the script runs its own mixed precision (an
            optimizer over half parameters, a ``GradScaler``), for which the
            launcher turned its AMP off; None if it did not.
    """
    if figures is None:
        return PREFIX + f"done: no mixed-precision run ({no_run_reason(settings, aside)})"
    rep, c = figures.report, figures.counters
    who = "the script's own initialize" if by_script else "the launcher"
    scales = c["loss_scale"]
    scale = ", ".join(f"{x:g}" for x in scales) or "-"
    kind = "dynamic" if any(loss["dynamic"] for loss in c["losses"]) else "static"
    if rep.collecting:
        casts = sum(o["casts"] for o in rep.ops.values())
        ops = f"ops cast: {casts} casts in {len(rep.ops)} patched ops"
    elif figures.patched:
        by_policy = ", ".join(f"{p} {n}" for p, n in sorted(figures.patched.items(), key=lambda kv: -kv[1]))
        ops = f"ops cast: {sum(figures.patched.values())} torch functions patched ({by_policy})"
    else:
        ops = f"ops cast: none patched, the model itself is {rep.half_dtype}"
    return (PREFIX + f"done: {rep.opt_level} in {rep.half_dtype}, set by {who}; {c['steps']} steps taken, "
            f"{c['skipped']} skipped; final loss scale {scale} ({kind}); {ops}")


# ------------------------------------------------------------------------- run


def check_script(script: Union[str, os.PathLike]) -> str:
    """The absolute path of ``script``, or ConfigError if it cannot be run.

    Example::

        path = check_script("train.py")
    """
    path = os.path.abspath(os.fspath(script))
    if not os.path.exists(path):
        raise ConfigError(f"script {os.fspath(script)!r} does not exist (looked for {path})")
    if os.path.isfile(path) and not os.access(path, os.R_OK):
        raise ConfigError(f"script {os.fspath(script)!r} cannot be read (permission denied)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        # what `python DIR` says, before anything starts
        raise ConfigError(f"can't find '__main__' module in {os.fspath(script)!r} (a folder runs its __main__.py)")
    return path


#: why the last ``run`` in this process ran no mixed precision (``Launch.no_run``); None if it did
last_no_run: Optional[str] = None


def run(script: Union[str, os.PathLike], args: Sequence[str] = (), settings: Optional[Settings] = None,
        stream: Optional[TextIO] = None) -> dict:
    """Run ``script`` as ``__main__`` with AMP on, as ``python script.py args...`` would.

    ``sys.argv``, ``__file__`` and ``sys.path[0]`` (the script's folder, for
    its sibling imports) are set as Python sets them; ``if __name__ ==
    "__main__":`` blocks run. The script's exceptions, ``SystemExit``
    included, propagate unchanged; ``sys.argv``, ``sys.path``, torch and
    ``apex`` are restored afterwards.

    Args:
        script: path to a ``.py`` file (or a folder / zip with ``__main__.py``).
        args: the script's command-line arguments.
        settings: the switches (default: from the environment variables).
        stream: where to write ``banner`` before the script and the
            ``summary`` line after it (``amp-patch run`` gives stderr, on
            rank 0 only); None says nothing.

    Returns:
        the script's module globals, as ``runpy.run_path`` returns them.

    Raises:
        ConfigError: bad settings or a missing script; the script never started.
        ListError: invalid op lists; the script never started.

    Example::

        from amp_patch.frontends import launcher
        launcher.run("train.py", ["--epochs", "1"], launcher.Settings.resolve(opt_level="O1"))
    """
    settings = settings if settings is not None else Settings.resolve()
    path = check_script(script)
    launch = Launch(settings)
    saved_argv, saved_path = sys.argv, list(sys.path)
    _say(stream, banner(settings, path))
    launch.start()
    try:
        sys.argv = [os.fspath(script), *args]
        sys.path[0:1] = [os.path.dirname(path) if os.path.isfile(path) else path]
        result = runpy.run_path(path, run_name="__main__")
    except BaseException:
        _restore(saved_argv, saved_path)
        try:
            launch.stop()
            _said(stream, launch)
        except Exception:  # the script's own error is the one to report
            log.exception("amp_patch: cleaning up after the script failed")
        raise
    _restore(saved_argv, saved_path)
    launch.stop()
    _said(stream, launch)
    return result


def _said(stream: Optional[TextIO], launch: Launch) -> None:
    """The summary line said, and why nothing ran kept in ``last_no_run``."""
    global last_no_run
    last_no_run = launch.no_run()
    _say(stream, launch.summary())


def _say(stream: Optional[TextIO], line: str) -> None:
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def _restore(argv: List[str], path: List[str]) -> None:
    sys.argv = argv
    sys.path[:] = path
