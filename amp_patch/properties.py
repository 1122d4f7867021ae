"""Opt levels O0-O5 and their properties, with Apex's names and forms.

| level | cast_model_type | patch_torch_functions | keep_batchnorm_fp32 | master_weights | loss_scale |
|-------|-----------------|-----------------------|---------------------|----------------|------------|
| O0    | float32         | False                 | None                | False          | 1.0        |
| O1    | None            | True                  | None                | False          | dynamic    |
| O2    | half            | False                 | True                | True           | dynamic    |
| O3    | half            | False                 | False               | False          | 1.0        |
| O4    | None (BF16 O1)  | True                  | None                | False          | 1.0        |
| O5    | BF16 (BF16 O2)  | False                 | True                | True           | 1.0        |

"half" is ``$AMP_PATCH_HALF_DTYPE`` when it is set, else FP16 on CUDA and
BF16 on CPU, unless ``half_dtype`` (or Apex's ``cast_model_type=torch.float16``)
says otherwise: every entry point (``initialize``, ``apex.amp.initialize``,
``amp.init``, the launcher) reads the variable the same way. Dynamic loss scaling
becomes 1.0 under BF16, whose range is FP32's; O4/O5 asked for FP16 scale
dynamically, as O1/O2 do.
"""
from __future__ import annotations

import os

import dataclasses
from typing import Any, Optional, Union

import torch

from .errors import ConfigError

OPT_LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
HALF = "half"  # placeholder resolved to the run's half dtype

_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast_model_type=HALF, patch_torch_functions=False, keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=HALF, patch_torch_functions=False, keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
    # O4/O5 are O1/O2 in BF16, whose scale is 1.0 (below); a run that asks them
    # for FP16 gets O1/O2's dynamic scale, which FP16 gradients need.
    "O4": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic"),
    "O5": dict(cast_model_type=HALF, patch_torch_functions=False, keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
}
_BF16_LEVELS = ("O4", "O5")

OVERRIDES = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights", "loss_scale", "cast_model_outputs")
#: options ``initialize`` accepts besides the Apex property overrides; the
#: modules that own them read them from ``Session.options``.
EXTRA_OPTIONS = (
    "num_losses", "min_loss_scale", "max_loss_scale", "init_scale", "growth_factor", "backoff_factor",
    "growth_interval", "hysteresis", "max_consecutive_skips", "keep_fp32", "save_dtype",
    "collect_stats", "find_overflow", "verbosity", "enabled", "fused_update", "allow_half_params", "cast_policy",
)

#: ``initialize``'s own parameters: a misspelling of one lands among the overrides
INITIALIZE_ARGS = ("models", "optimizers", "opt_level", "half_dtype", "lists")

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
}


def parse_dtype(value: Any, what: str = "half_dtype", allowed=(torch.float16, torch.bfloat16)) -> torch.dtype:
    """``torch.float16`` / ``"float16"`` / ``"bf16"`` ... -> a torch dtype, or ConfigError."""
    dt = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if dt not in allowed:
        names = ", ".join(f"torch.{str(a).split('.')[-1]}" for a in allowed)
        raise ConfigError(f"{what}={value!r} is not supported; use one of {names} (or their names as strings)")
    return dt


def _parse_bool(name: str, value: Any) -> Optional[bool]:
    # Apex's command-line scripts pass strings ("True", "False", "None").
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[value.strip().lower()]
    raise ConfigError(f"{name}={value!r} must be True, False or None (or the strings 'True'/'False')")


def _parse_loss_scale(value: Any) -> Union[str, float]:
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"loss_scale={value!r} must be 'dynamic' or a positive number") from None
    if not f > 0 or f == float("inf"):
        raise ConfigError(f"loss_scale={value!r} must be 'dynamic' or a positive, finite number")
    return f


@dataclasses.dataclass(frozen=True)
class Properties:
    """The resolved settings of one AMP run. Frozen: built once by ``resolve``."""

    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: Union[str, float]
    cast_model_outputs: Optional[torch.dtype]

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"



#: the environment variable every entry point takes its half dtype from when none is given
ENV_HALF_DTYPE = "AMP_PATCH_HALF_DTYPE"


def default_half_dtype(device_type: str) -> torch.dtype:
    """``$AMP_PATCH_HALF_DTYPE`` when set; else FP16 on CUDA (Tensor Cores, the
    fastest choice on every GPU), BF16 on CPU."""
    raw = os.environ.get(ENV_HALF_DTYPE, "").strip()
    if raw:
        return parse_dtype(raw, ENV_HALF_DTYPE)
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def resolve(opt_level: Any, device_type: str, half_dtype: Any = None, **overrides: Any) -> Properties:
    """Validate an opt level and overrides into ``Properties``; raise ConfigError.

    Nothing is changed anywhere: callers resolve before they patch.
    """
    if not isinstance(opt_level, str):
        raise ConfigError(f"opt_level={opt_level!r} is a {type(opt_level).__name__}, not an opt level; pass one string: "
                          f"one of {', '.join(OPT_LEVELS)}")
    level = opt_level.upper()
    if level not in _LEVELS:
        hint = " (the letter O, not zero)" if isinstance(opt_level, str) and opt_level.startswith("0") else ""
        raise ConfigError(f"opt_level={opt_level!r} is not an opt level{hint}; use one of {', '.join(OPT_LEVELS)}")
    unknown = [k for k in overrides if k not in OVERRIDES]
    if unknown:
        import difflib

        known = INITIALIZE_ARGS + OVERRIDES + EXTRA_OPTIONS
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, 1)) else "") for k in unknown]
        raise ConfigError(
            f"unknown option {', '.join(hints)} for initialize; apex.amp's overrides: {', '.join(OVERRIDES)}; "
            f"amp_patch's options: {', '.join(EXTRA_OPTIONS)}"
        )
    p = dict(_LEVELS[level])
    cmt = overrides.get("cast_model_type", p["cast_model_type"])
    if cmt is False:
        cmt = None  # Apex: leave the model's dtypes as they are
    elif cmt is not None and cmt != HALF:
        cmt = parse_dtype(cmt, "cast_model_type", (torch.float16, torch.bfloat16, torch.float32))
    # The run's half dtype: half_dtype=, else an Apex-style cast_model_type=torch.float16
    # (the dtype the model is cast to is the one its ops and loss scaling are for),
    # else the level's or the device's.
    named = cmt if cmt in (torch.float16, torch.bfloat16) else None
    if half_dtype is not None:
        half = parse_dtype(half_dtype)
        if named is not None and named != half:
            raise ConfigError(
                f"cast_model_type={named} and half_dtype={half} disagree; give one of them "
                f"(half_dtype={half} alone casts the model to {half} at O2/O3/O5)"
            )
    elif named is not None:
        half = named
    elif level in _BF16_LEVELS:
        half = torch.bfloat16
    else:
        half = default_half_dtype(device_type)
    if cmt == HALF:
        cmt = half

    for key in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
        if overrides.get(key) is not None:
            p[key] = _parse_bool(key, overrides[key])
    if overrides.get("loss_scale") is not None:
        p["loss_scale"] = _parse_loss_scale(overrides["loss_scale"])
    elif half == torch.bfloat16:
        p["loss_scale"] = 1.0  # BF16 has FP32's exponent range: nothing to scale
    out = overrides.get("cast_model_outputs")
    if out is not None:
        out = parse_dtype(out, "cast_model_outputs", (torch.float16, torch.bfloat16, torch.float32))

    props = Properties(
        opt_level=level,
        half_dtype=half,
        cast_model_type=cmt,
        patch_torch_functions=bool(p["patch_torch_functions"]),
        keep_batchnorm_fp32=p["keep_batchnorm_fp32"],
        master_weights=bool(p["master_weights"]),
        loss_scale=p["loss_scale"],
        cast_model_outputs=out,
    )
    _check(props)
    return props


def _check(p: Properties) -> None:
    # With cast_model_type None (O1, or Apex's cast_model_type=False) the model
    # keeps its own dtypes; whether it holds half parameters that need masters
    # is checked against the model itself (model.validate).
    if p.master_weights and p.cast_model_type == torch.float32:
        raise ConfigError(
            "master_weights=True with cast_model_type=torch.float32 makes no sense: FP32 master "
            "weights exist to back a half-precision model. Use opt_level='O2' (or O5), or drop master_weights."
        )
