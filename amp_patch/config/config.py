"""One AMP run's configuration: an opt-level preset plus overrides, frozen,
checked once.

Every entry point builds it through ``parse``: ``amp_patch.initialize``,
``apex.amp.initialize``, the 2018 ``amp.init``, the launcher's flags and
environment variables (``frontends.launcher.Settings``). A bad value raises
``ConfigError`` naming where it came from (a keyword, a flag, a variable) and
the fix, before anything changes.

Each option is written once, as a field here: its name, default and **scope**
(the field's ``metadata``) are where ``--help``, the errors, the README and
the session's rules read them from:

- ``"level"``: what an opt level sets (Apex's property names); every
  ``initialize`` of one session must agree on them.
- ``"session"``: the loss scalers, the skip limit, statistics, overflow
  provenance, verbosity, the cast policy, the op lists. The first
  ``initialize`` sets them; a later call that names a different value is
  refused with the difference (leaving one out keeps the running value).
- ``"call"``: ``keep_fp32``, ``save_dtype``, ``fused_update``, ``model_grads``, ``enabled``,
  ``allow_half_params``: they apply to the models and optimizers of the call
  that gives them.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Callable, FrozenSet, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from ..base.errors import ConfigError
from .presets import HALF, OPT_LEVELS, PRESETS

#: the environment variable every entry point takes its half dtype from when none is given
ENV_HALF_DTYPE = "AMP_PATCH_HALF_DTYPE"
#: ``cast_policy``: "parity" casts as torch.autocast does; "auto" keeps half-list
#: matmuls too small for the half kernel to win, and attention whose half kernel
#: is slower here, in FP32 (``patching.costs``, ``patching.attention``)
CAST_POLICIES = ("parity", "auto")
#: ``fp8_recipe`` (O6/O7): torchao's FP8 scaling recipes (``precision.fp8``)
FP8_RECIPES = ("tensorwise", "rowwise")
#: the default of ``max_consecutive_skips``: that many skipped steps in a row at
#: the minimum loss scale raise ``OverflowLoopError``
MAX_CONSECUTIVE_SKIPS = 20

LossScale = Union[str, float]
KeepFP32 = Union[None, Tuple[str, ...], Callable[[nn.Module, str], bool]]
#: op-list overrides as given: YAML paths and dicts (``oplists.load`` reads them)
Lists = Optional[Tuple[object, ...]]
#: ``fp8_layers`` as given: "auto", "all", module-name patterns or a filter
Fp8Layers = Union[str, Tuple[str, ...], Callable[[nn.Module, str], bool]]

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
}
HALF_DTYPES = (torch.float16, torch.bfloat16)
ANY_DTYPE = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------ one value


def parse_dtype(value: object, what: str = "half_dtype", allowed: Tuple[torch.dtype, ...] = HALF_DTYPES) -> torch.dtype:
    """``torch.float16`` / ``"float16"`` / ``"bf16"`` ... -> a torch dtype, or ConfigError naming ``what``."""
    dt = value if isinstance(value, torch.dtype) else _DTYPES.get(value.lower()) if isinstance(value, str) else None
    if dt not in allowed:
        names = ", ".join(f"torch.{str(a).split('.')[-1]}" for a in allowed)
        raise ConfigError(f"{what}={value!r} is not supported; use one of {names} (or their names as strings)")
    return dt


def parse_level(value: object, what: str = "opt_level") -> str:
    """An opt level (any case) -> ``"O0"`` ... ``"O7"``, or ConfigError naming ``what``."""
    if not isinstance(value, str):
        raise ConfigError(f"{what}={value!r} is a {type(value).__name__}, not an opt level; pass one string: "
                          f"one of {', '.join(OPT_LEVELS)}")
    level = value.strip().upper()
    if level not in PRESETS:
        hint = " (the letter O, not zero)" if level.startswith("0") else ""
        raise ConfigError(f"{what}={value!r} is not an opt level{hint}; use one of {', '.join(OPT_LEVELS)}")
    return level


def parse_loss_scale(value: object, what: str = "loss_scale") -> LossScale:
    """``"dynamic"`` or a positive finite number (Apex's scripts pass strings), or ConfigError."""
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = math.nan
    if isinstance(value, bool) or not (f > 0 and math.isfinite(f)):
        raise ConfigError(f"{what}={value!r} is not a loss scale; use 'dynamic' or a positive, finite number such as 128")
    return f


def parse_bool(value: object, what: str) -> Optional[bool]:
    """True / False / None, or Apex's command-line strings ``"True"``, ``"False"``, ``"None"``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[value.strip().lower()]
    raise ConfigError(f"{what}={value!r} must be True, False or None (or the strings 'True'/'False')")


def default_half_dtype(device_type: str) -> torch.dtype:
    """``$AMP_PATCH_HALF_DTYPE`` when set; else FP16 on CUDA (Tensor Cores, the
    fastest choice on every GPU), BF16 on CPU."""
    raw = os.environ.get(ENV_HALF_DTYPE, "").strip()
    if raw:
        return parse_dtype(raw, ENV_HALF_DTYPE)
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{what}={value!r} must be a finite number")
    return float(value)


def _count(what: str, value: object, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}={value!r} must be an integer >= 1{f' ({why})' if why else ''}")
    return value


def _scope(scope: str, default: object = None, **kw: object) -> dataclasses.Field:  # type: ignore[type-arg]
    return dataclasses.field(default=default, metadata={"scope": scope}, **kw)  # type: ignore[call-overload]


# ---------------------------------------------------------------- the scaler


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """The loss scaling of a run: its form and, when dynamic, its dynamics.

    The defaults are Apex's and ``torch.amp.GradScaler``'s. ``hysteresis=N``
    is DeepSpeed's: back off only on the N-th overflow since the last growth.
    """

    #: ``"dynamic"`` or a fixed positive scale (1.0: no scaling at all)
    loss_scale: LossScale = _scope("level", "dynamic")
    num_losses: int = _scope("session", 1)
    init_scale: float = _scope("session", 2.0**16)
    growth_factor: float = _scope("session", 2.0)
    backoff_factor: float = _scope("session", 0.5)
    growth_interval: int = _scope("session", 2000)
    hysteresis: int = _scope("session", 1)
    min_loss_scale: float = _scope("session", 1.0)
    max_loss_scale: float = _scope("session", 2.0**24)
    #: that many skipped steps in a row at the minimum scale raise ``OverflowLoopError`` (None: never)
    max_consecutive_skips: Optional[int] = _scope("session", MAX_CONSECUTIVE_SKIPS)

    def __post_init__(self) -> None:
        if self.loss_scale != "dynamic":
            object.__setattr__(self, "loss_scale", parse_loss_scale(self.loss_scale))
        _count("num_losses", self.num_losses, "one loss scaler per loss")
        if _number("growth_factor", self.growth_factor) <= 1.0:
            raise ConfigError(f"growth_factor={self.growth_factor!r} must be > 1 (the scale grows by it)")
        if not 0.0 < _number("backoff_factor", self.backoff_factor) < 1.0:
            raise ConfigError(f"backoff_factor={self.backoff_factor!r} must be in (0, 1) (the scale shrinks by it)")
        _count("growth_interval", self.growth_interval)
        _count("hysteresis", self.hysteresis)
        if _number("min_loss_scale", self.min_loss_scale) <= 0:
            raise ConfigError(f"min_loss_scale={self.min_loss_scale!r} must be > 0")
        if _number("max_loss_scale", self.max_loss_scale) < self.min_loss_scale:
            raise ConfigError(f"max_loss_scale={self.max_loss_scale!r} must be >= min_loss_scale={self.min_loss_scale!r}")
        if _number("init_scale", self.init_scale) <= 0:
            raise ConfigError(f"init_scale={self.init_scale!r} must be > 0")
        if self.dynamic and not self.min_loss_scale <= self.init_scale <= self.max_loss_scale:
            raise ConfigError(
                f"init_scale={self.init_scale!r} must lie in [min_loss_scale, max_loss_scale] = "
                f"[{self.min_loss_scale!r}, {self.max_loss_scale!r}]"
            )
        if self.max_consecutive_skips is not None:
            _count("max_consecutive_skips", self.max_consecutive_skips, "or None to never stop")

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"


SCALER_FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ScalerConfig))


# ---------------------------------------------------------------- the config


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """The resolved settings of one AMP run. Frozen: built once by ``parse``.

    The ``"level"`` fields are Apex's properties (see ``presets``); the rest
    are amp_patch's options (see ``amp_patch.initialize`` for each).
    """

    opt_level: str = _scope("level", "O1")
    half_dtype: torch.dtype = _scope("level", torch.bfloat16)
    #: the dtype the model is cast to; None: the model keeps its dtypes
    cast_model_type: Optional[torch.dtype] = _scope("level")
    patch_torch_functions: bool = _scope("level", True)
    keep_batchnorm_fp32: Optional[bool] = _scope("level")
    master_weights: bool = _scope("level", False)
    #: the dtype of the models' floating outputs (Apex's), None: as computed
    cast_model_outputs: Optional[torch.dtype] = _scope("level")
    scaler: ScalerConfig = _scope("level", default_factory=ScalerConfig, default=dataclasses.MISSING)
    collect_stats: bool = _scope("session", False)
    find_overflow: bool = _scope("session", False)
    #: 0 silences amp_patch's informational messages
    verbosity: int = _scope("session", 1)
    cast_policy: str = _scope("session", "parity")
    #: the loss scale and the overflow verdict stay on the device: a step makes no
    #: host sync where its optimizer's update can take the verdict (``scaling.state``);
    #: False decides each step on the host, with one sync
    sync_free: bool = _scope("session", True)
    #: op-list overrides (None: the shipped lists and ``$AMP_PATCH_LISTS``)
    lists: Lists = _scope("session")
    #: O6/O7: torchao's FP8 scaling recipe, "tensorwise" or "rowwise" (``precision.fp8``)
    fp8_recipe: str = _scope("session", "tensorwise")
    keep_fp32: KeepFP32 = _scope("call")
    save_dtype: torch.dtype = _scope("call", torch.float32)
    fused_update: bool = _scope("call", False)
    #: O2/O5: after a backward the model's ``.grad`` reads each true gradient in the
    #: half dtype; False moves half gradients into the masters as they arrive instead
    model_grads: bool = _scope("call", True)
    enabled: bool = _scope("call", True)
    #: O1/O4: accept FP16/BF16 parameters in the optimizer and step them as they
    #: are (Apex's ``_amp_state.allow_incoming_model_not_fp32``)
    allow_half_params: bool = _scope("call", False)
    #: O6/O7: which ``nn.Linear`` layers compute in FP8: "auto" (the shapes that gain, first
    #: and last kept), "all", module-name patterns or a filter (``precision.fp8``)
    fp8_layers: Fp8Layers = _scope("call", "auto")
    #: the option names the caller passed, so a later call compares only those
    given: FrozenSet[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("collect_stats", "find_overflow", "sync_free", "fused_update", "model_grads", "enabled",
                     "allow_half_params"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"initialize: {name}={getattr(self, name)!r} must be True or False")
        v = self.verbosity
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"initialize: verbosity={v!r} must be an integer >= 0 (0 silences amp_patch's messages, 1 is the default)")
        object.__setattr__(self, "save_dtype", parse_dtype(self.save_dtype, "save_dtype", ANY_DTYPE))
        object.__setattr__(self, "keep_fp32", _keep_fp32(self.keep_fp32))
        if self.cast_policy not in CAST_POLICIES:
            raise ConfigError(
                f"initialize: cast_policy={self.cast_policy!r} must be 'parity' (cast as torch.autocast does, the "
                f"default at O1/O4) or 'auto' (keep matmuls too small for the half dtype to win, and attention "
                f"measured faster in float32 here, in float32; the default at O2/O3/O5)"
            )
        if self.master_weights and self.cast_model_type == torch.float32:
            raise ConfigError(
                "master_weights=True with cast_model_type=torch.float32 makes no sense: FP32 master "
                "weights exist to back a half-precision model. Use opt_level='O2' (or O5), or drop master_weights."
            )
        self._check_fp8()

    def _check_fp8(self) -> None:
        """``fp8_recipe`` and ``fp8_layers``: valid, and given only at O6/O7."""
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"initialize: fp8_recipe={self.fp8_recipe!r} must be one of "
                              f"{', '.join(repr(r) for r in FP8_RECIPES)} (torchao's FP8 scaling recipes)")
        object.__setattr__(self, "fp8_layers", _fp8_layers(self.fp8_layers))
        named = [k for k in ("fp8_recipe", "fp8_layers") if k in self.given]
        if named and not self.fp8_level:
            raise ConfigError(
                f"initialize: {named[0]}= chooses how nn.Linear layers compute in FP8, which only O6 and O7 do; "
                f"opt_level={self.opt_level!r} has no FP8. Use O6 or O7, or drop {named[0]}."
            )

    @property
    def fp8_level(self) -> int:
        """FP8 on top of O5: 0 none, 1 at O6 (``nn.Linear`` GEMMs), 2 at O7 (and Adam's moments)."""
        preset = PRESETS.get(self.opt_level)
        return preset.fp8 if preset is not None else 0

    # the loss scale's form, read often
    @property
    def loss_scale(self) -> LossScale:
        return self.scaler.loss_scale

    @property
    def dynamic(self) -> bool:
        return self.scaler.dynamic

    @property
    def level_fields(self) -> Tuple[object, ...]:
        """What every ``initialize`` of one session must agree on."""
        return tuple(self.get(n) for n in LEVEL_WIDE)

    def same_level(self, other: "AmpConfig") -> bool:
        """True when ``other`` asks for the same opt-level properties (Apex's)."""
        return self.level_fields == other.level_fields

    def differences(self, running: "AmpConfig") -> List[str]:
        """Session-wide options this call names with values the running session does not have."""
        return [
            f"{k}={self.get(k)!r} (running: {running.get(k)!r})"
            for k in SESSION_WIDE
            if k in self.given and self.get(k) != running.get(k)
        ]

    def get(self, name: str) -> object:
        """An option by its keyword name (a scaler setting included)."""
        return getattr(self.scaler, name) if name in SCALER_FIELDS else getattr(self, name)

    def with_session_options(self, call: "AmpConfig") -> "AmpConfig":
        """These settings with the session-wide options ``call`` names (Apex's
        "the last amp.initialize sets them")."""
        names = [k for k in SESSION_WIDE if k in call.given]
        return self.replace(**{k: call.get(k) for k in names})

    def replace(self, **changes: object) -> "AmpConfig":
        """A copy with ``changes``, scaler settings given by their keyword names."""
        scaler = {k: changes.pop(k) for k in list(changes) if k in SCALER_FIELDS}
        if scaler:
            changes["scaler"] = dataclasses.replace(self.scaler, **scaler)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def scoped(scope: str) -> Tuple[str, ...]:
    """The option names of one scope (``"level"``, ``"session"``, ``"call"``), by keyword name."""
    names: List[str] = []
    for f in dataclasses.fields(AmpConfig):
        if f.name == "scaler":
            names += [s.name for s in dataclasses.fields(ScalerConfig) if s.metadata.get("scope") == scope]
        elif f.metadata.get("scope") == scope:
            names.append(f.name)
    return tuple(names)


#: Apex's property overrides of an opt level
OVERRIDES: Tuple[str, ...] = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                              "loss_scale", "cast_model_outputs")
#: every keyword ``initialize`` takes after the models, optimizers and opt level
OPTIONS: Tuple[str, ...] = ("half_dtype",) + OVERRIDES + tuple(
    n for n in scoped("level") + scoped("session") + scoped("call")
    if n not in OVERRIDES and n not in ("opt_level", "half_dtype"))
#: amp_patch's own options (not Apex's properties)
EXTRA_OPTIONS: Tuple[str, ...] = tuple(n for n in OPTIONS if n not in OVERRIDES and n != "half_dtype")
LEVEL_WIDE: Tuple[str, ...] = scoped("level")
SESSION_WIDE: Tuple[str, ...] = scoped("session")
PER_CALL: Tuple[str, ...] = scoped("call")


# ---------------------------------------------------------------- the parser


def parse(
    opt_level: object = "O1",
    device_type: str = "cpu",
    *,
    half_dtype: object = None,
    names: Optional[Mapping[str, str]] = None,
    **options: object,
) -> AmpConfig:
    """Validate an opt level and options into an ``AmpConfig``; raise ConfigError.

    Nothing is changed anywhere: callers parse before they patch.

    Args:
        opt_level: ``"O0"`` ... ``"O7"`` (any case).
        device_type: the models' device type, for the default half dtype.
        half_dtype: FP16 / BF16 (or their names); None: Apex's
            ``cast_model_type=torch.float16`` names it, else the level's
            (BF16 at O4/O5), else ``$AMP_PATCH_HALF_DTYPE``, else the device's.
        names: how to name an input in errors when it did not come as a
            keyword (``{"opt_level": "--opt-level"}``, a variable's name).
        **options: any of ``OPTIONS``; None means "not given" (the default),
            except ``max_consecutive_skips``, where it means "never stop".

    Example::

        config = parse("O2", "cpu", half_dtype="bfloat16", keep_fp32=["head"])
    """
    names = dict(names or {})

    def named(key: str) -> str:
        return names.get(key, key)

    level = parse_level(opt_level, named("opt_level"))
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        known = ("models", "optimizers", "opt_level", "lists") + OPTIONS
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, 1)) else "")
                 for k in unknown]
        raise ConfigError(
            f"unknown option {', '.join(hints)} for initialize; apex.amp's overrides: {', '.join(OVERRIDES)}; "
            f"amp_patch's options: {', '.join(EXTRA_OPTIONS)}"
        )
    given = {k: v for k, v in options.items() if v is not None or k == "max_consecutive_skips"}
    preset = PRESETS[level]

    cmt: object = given.get("cast_model_type", preset.cast_model_type)
    if cmt is False:
        cmt = None  # Apex: leave the model's dtypes as they are
    elif cmt is not None and cmt != HALF:
        cmt = parse_dtype(cmt, named("cast_model_type"), ANY_DTYPE)
    # The run's half dtype: half_dtype=, else an Apex-style cast_model_type=torch.float16
    # (the dtype the model is cast to is the one its ops and loss scaling are for),
    # else the level's or the device's.
    said = cmt if cmt in HALF_DTYPES else None
    if half_dtype is not None:
        half = parse_dtype(half_dtype, named("half_dtype"))
        if said is not None and said != half:
            raise ConfigError(
                f"cast_model_type={said} and half_dtype={half} disagree; give one of them "
                f"(half_dtype={half} alone casts the model to {half} at O2/O3/O5)"
            )
    elif said is not None:
        half = said
    elif preset.bf16:
        half = torch.bfloat16
    else:
        half = default_half_dtype(device_type)
    if cmt == HALF:
        cmt = half

    flags = {k: parse_bool(given[k], named(k)) if k in given else getattr(preset, k)
             for k in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights")}
    if "loss_scale" in given:
        scale: LossScale = parse_loss_scale(given["loss_scale"], named("loss_scale"))
    elif half == torch.bfloat16:
        scale = 1.0  # BF16 has FP32's exponent range: nothing to scale
    else:
        scale = preset.loss_scale
    out = given.get("cast_model_outputs")
    if out is not None:
        out = parse_dtype(out, named("cast_model_outputs"), ANY_DTYPE)
    scaler = ScalerConfig(scale, **{k: given[k] for k in SCALER_FIELDS if k in given and k != "loss_scale"})
    rest = {k: v for k, v in given.items() if k not in SCALER_FIELDS and k not in OVERRIDES}
    if "lists" in rest:
        rest["lists"] = _lists(rest["lists"])
    rest.setdefault("cast_policy", preset.cast_policy)
    return AmpConfig(
        opt_level=level, half_dtype=half, cast_model_type=cmt,  # type: ignore[arg-type]
        patch_torch_functions=bool(flags["patch_torch_functions"]), keep_batchnorm_fp32=flags["keep_batchnorm_fp32"],
        master_weights=bool(flags["master_weights"]), cast_model_outputs=out,  # type: ignore[arg-type]
        scaler=scaler, given=frozenset(given), **rest,  # type: ignore[arg-type]
    )


def _lists(value: object) -> Lists:
    """Op-list overrides as a tuple of sources (a path, a dict, or a list of them)."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _fp8_layers(value: object) -> Fp8Layers:
    """``fp8_layers`` as "auto", "all", a tuple of module-name patterns, or a callable."""
    if callable(value) or value in ("auto", "all"):
        return value  # type: ignore[return-value]
    patterns = (value,) if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(
            f"fp8_layers={value!r} must be 'auto' (the layers whose shapes gain from FP8), 'all', a list of "
            f"module-name patterns such as ['blocks.*.mlp.*'], or a callable (module, name) -> bool"
        )
    return tuple(patterns)


def _keep_fp32(value: object) -> KeepFP32:
    """``keep_fp32`` as a tuple of module-name patterns, a callable, or None.

    Whether each pattern matches a module is checked against the models
    (``precision.model.validate``), which this object does not see.
    """
    if value is None or callable(value):
        return value  # type: ignore[return-value]
    patterns = (value,) if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(
            f"keep_fp32={value!r} must be a callable (module, name) -> bool or a list of "
            f"module-name patterns such as ['classifier', '*.norm*']"
        )
    return tuple(patterns)
