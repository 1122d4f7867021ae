"""O7's optimizer state in low precision: Adam's moments in FP8 and BF16.

Between steps each parameter's Adam state is kept as

- ``exp_avg`` (the first moment): FP8 E4M3 with a per-tensor scale, a power of
  two kept beside it as ``exp_avg_scale`` (an FP32 scalar): the scale puts the
  tensor's largest magnitude in E4M3's top binade (``encode``), so the moment
  keeps E4M3's 3 mantissa bits over a range of 2^17 below its largest entry;
  smaller entries flush to zero (they would move a weight by nothing anyway);
- ``exp_avg_sq`` (and AMSGrad's ``max_exp_avg_sq``): BF16, 8 bits of mantissa and
  FP32's exponent range. It needs no scale, and it must never flush to zero:
  ``m / (sqrt(v) + eps)`` with a ``v`` flushed to zero would be a step of
  ``m / eps``, which is what FP8 or FP16 second moments risk;
- ``step``: as the optimizer keeps it.

That is 3 bytes per parameter instead of FP32's 8 (MS-AMP's second level keeps
the first moment in FP8 and the second in FP16). The FP32 master weights stay
(``precision.master``).

The update itself is the optimizer's own: a step pre-hook decodes the moments
into FP32 tensors, ``torch.optim.Adam``/``AdamW`` steps the masters with them,
and a step post-hook encodes them again, so the arithmetic of every step is
torch's, on moments rounded once per step. A skipped step (an FP16 overflow)
runs neither hook and leaves the state as it was; a step whose update takes the
skip verdict on the device changes nothing either, since decoding and
encoding again gives back the same values (``encode`` of a decoded tensor is
exact: its scale is a power of two). Because of the hooks the one-pass C step
(``amp_patch.precision.onepass``) stands aside at O7 and torch's step runs.

**Checkpoints.** ``optimizer.state_dict()`` holds the moments decoded, as FP32
tensors, which any Adam loads (the checkpoint of an O6 run, or of a plain
one); ``load_state_dict`` encodes them again, to the same values, so a run
resumed from a checkpoint continues bit for bit. ``deinitialize`` leaves the
optimizer with its moments decoded into FP32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

import torch

from ..base.errors import ConfigError
from ..config import AmpConfig

if TYPE_CHECKING:
    from ..base.undo import Owned

Tensor = torch.Tensor
f32 = torch.float32
FP8 = torch.float8_e4m3fn
#: the largest finite E4M3 value: 0.875 * 2**9
FP8_MAX = 448.0
#: each moment's storage: (dtype, scaled)
FORMATS: Dict[str, Tuple[torch.dtype, bool]] = {
    "exp_avg": (FP8, True),
    "exp_avg_sq": (torch.bfloat16, False),
    "max_exp_avg_sq": (torch.bfloat16, False),
}
SCALE = "_scale"
#: the optimizers whose moments O7 keeps (and their subclasses)
ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def encode(x: Tensor) -> Tuple[Tensor, Tensor]:
    """``x`` (FP32) as E4M3 with a per-tensor power-of-two scale: ``(payload, scale)``.

    The scale is ``2**k`` with the smallest ``k`` for which ``amax / 2**k <=
    448`` (``frexp`` gives ``k`` exactly), so ``x / scale`` is exact and its
    largest magnitude lands in (224, 448]. A tensor of zeros gets the scale
    1. ``decode(*encode(decode(p, s)))`` equals ``decode(p, s)``.
    """
    amax = x.detach().abs().amax().to(f32) if x.numel() else torch.zeros((), device=x.device)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    k = exp - 9 + (mant > FP8_MAX / 512).to(exp.dtype)
    k = torch.where(amax > 0, k, torch.zeros_like(k)).clamp(-126, 127)
    scale = torch.ldexp(torch.ones((), device=x.device), k)
    return (x / scale).to(FP8), scale


def decode(payload: Tensor, scale: Tensor) -> Tensor:
    """The FP32 tensor an ``encode`` stands for (exact)."""
    return payload.to(f32) * scale


def pack(state: Dict[str, Any]) -> None:
    """Encode one parameter's moments in place (those already encoded stay)."""
    for key, (dtype, scaled) in FORMATS.items():
        v = state.get(key)
        if not isinstance(v, Tensor) or not v.is_floating_point():
            continue
        s = state.get(key + SCALE)
        if scaled and isinstance(s, Tensor):
            if v.dtype == dtype:
                continue  # already encoded
            v = v.to(f32) * s  # a payload a load made FP32: decode first
        if v.dtype == dtype and not scaled:
            continue
        if scaled:
            state[key], state[key + SCALE] = encode(v.to(f32))
        else:
            state[key] = v.to(dtype)


def unpack(state: Dict[str, Any], dtype: torch.dtype = f32) -> Dict[str, Any]:
    """One parameter's state with its moments decoded into ``dtype``, its
    parameter's (FP32 for a master), as a new dict; ``state`` is untouched."""
    out = dict(state)
    for key, (_, scaled) in FORMATS.items():
        v = out.get(key)
        if not isinstance(v, Tensor) or not v.is_floating_point():
            continue
        s = out.pop(key + SCALE, None) if scaled else None
        if isinstance(s, Tensor):
            out[key] = decode(v, s).to(dtype)
        elif v.dtype != dtype:
            out[key] = v.to(dtype)
    return out


def _dtype(param: object) -> torch.dtype:
    return param.dtype if isinstance(param, Tensor) and param.is_floating_point() else f32


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (its ``step`` counters and scales included)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, Tensor))


class LowPrecisionState:
    """Keeps one Adam's moments in FP8/BF16 between steps (see the module docstring).

    Its hooks: a step pre-hook (decode), a step post-hook (encode), a
    ``state_dict`` post-hook (FP32 moments out) and a ``load_state_dict``
    post-hook (encode what came in). Calling it is its undo: the hooks go, and
    the moments are left decoded in FP32.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.handles: List[Any] = []

    def start(self) -> None:
        """Encode the state the optimizer holds already and register the hooks."""
        opt = self.optimizer
        self.pack_all()
        self.handles = [
            opt.register_step_pre_hook(self._before_step),
            opt.register_step_post_hook(self._after_step),
            opt.register_state_dict_post_hook(self._saved),
            opt.register_load_state_dict_post_hook(self._loaded),
        ]

    @torch.no_grad()
    def pack_all(self) -> None:
        for state in self.optimizer.state.values():
            pack(state)

    @torch.no_grad()
    def unpack_all(self) -> None:
        st = self.optimizer.state
        for p in list(st):
            st[p] = unpack(st[p], _dtype(p))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.unpack_all()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.pack_all()

    @torch.no_grad()
    def _saved(self, optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        params = [p for g in optimizer.param_groups for p in g["params"]]  # the state dict's numbering
        state_dict["state"] = {k: unpack(v, _dtype(params[k]) if isinstance(k, int) and k < len(params) else f32)
                               for k, v in state_dict["state"].items()}
        return state_dict

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.pack_all()

    def __call__(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.unpack_all()

    def __repr__(self) -> str:
        return f"amp_patch.LowPrecisionState({type(self.optimizer).__name__})"


def validate(optimizers: Sequence[torch.optim.Optimizer], config: AmpConfig) -> None:
    """At O7, refuse an optimizer whose state O7 cannot keep, before anything changes."""
    if config.fp8_level < 2:
        return
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, ADAMS):
            raise ConfigError(
                f"opt_level={config.opt_level!r} keeps Adam's moments in FP8 and BF16, but optimizer {i} is "
                f"{type(opt).__module__}.{type(opt).__qualname__}, not torch.optim.Adam or AdamW. Use O6 (the same "
                f"FP8 layers, FP32 optimizer state) for it."
            )
    if config.fused_update:
        raise ConfigError(
            f"fused_update=True steps the optimizer state as FP32 tensors in a compiled pass; at "
            f"opt_level={config.opt_level!r} the moments are FP8/BF16 between steps and torch's own step "
            f"updates them. Drop fused_update, or use O6."
        )


def attach(undo: "Owned", optimizers: Sequence[torch.optim.Optimizer], config: AmpConfig) -> None:
    """At O7, keep each optimizer's moments in FP8/BF16, pushing the undo onto ``undo`` as it is made."""
    if config.fp8_level < 2:
        return
    for opt in optimizers:
        codec = LowPrecisionState(opt)
        undo.push(codec)  # before the first change: a failure half way is undone too
        codec.start()
