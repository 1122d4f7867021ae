"""The loss scaler: one explicit state machine per loss, on the host.

A ``LossScaler`` holds the scale as a Python float and changes it only in
``update(found_inf)``, which the step logic calls once per step with the
overflow skip decision for that loss. Keeping the scale on the host costs nothing:
the skip decision needs one host sync per step anyway (the skip decision), and a
float scale multiplies a loss without a device tensor.

Dynamic scaling follows ``torch.amp.GradScaler`` and Apex: start at
``init_scale`` (2**16), multiply by ``growth_factor`` (2) after
``growth_interval`` (2000) steps without overflow, multiply by
``backoff_factor`` (0.5) on overflow, clamped to ``[min_scale, max_scale]``.
``hysteresis=N`` is DeepSpeed's: back off only on the N-th overflow since the
last growth. A static scaler never changes its scale. A static scale of 1.0 is
*inactive*: nothing is scaled, unscaled or checked (the BF16 default).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Deque, Dict, List, Tuple, Union

from ..config import ScalerConfig

#: the defaults of Apex and ``torch.amp.GradScaler`` (``config.ScalerConfig``'s)
DEFAULTS: Dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ScalerConfig)
                            if f.name not in ("loss_scale", "num_losses", "max_consecutive_skips")}

def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    return float(value)


#: how many updates ``history`` keeps (a long run must not grow memory)
HISTORY_LENGTH = 10_000


class LossScaler:
    """The scale of one loss and its dynamics.

    Args:
        loss_scale: ``"dynamic"`` or a fixed positive scale.
        init_scale: first scale of a dynamic scaler (2**16).
        growth_factor: factor applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: factor applied on overflow (in (0, 1)).
        growth_interval: clean steps between growths (>= 1).
        hysteresis: overflows tolerated before backing off (>= 1).
        min_loss_scale: lowest scale a dynamic scaler backs off to (> 0).
        max_loss_scale: highest scale it grows to (>= ``min_loss_scale``).

    Raises:
        ValueError: naming the argument, for any invalid value.

    Example::

        scaler = LossScaler("dynamic", growth_interval=3)
        scaler.update(found_inf=True)     # scale 65536 -> 32768, step skipped
        scaler.scale                      # 32768.0
    """

    def __init__(
        self,
        loss_scale: Union[str, float] = "dynamic",
        *,
        init_scale: float = DEFAULTS["init_scale"],
        growth_factor: float = DEFAULTS["growth_factor"],
        backoff_factor: float = DEFAULTS["backoff_factor"],
        growth_interval: int = DEFAULTS["growth_interval"],
        hysteresis: int = DEFAULTS["hysteresis"],
        min_loss_scale: float = DEFAULTS["min_loss_scale"],
        max_loss_scale: float = DEFAULTS["max_loss_scale"],
    ):
        # the rules are ScalerConfig's, written once; a ConfigError is a ValueError
        cfg = ScalerConfig(loss_scale, init_scale=init_scale, growth_factor=growth_factor,
                           backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis,
                           min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale)
        self.dynamic = cfg.dynamic
        self.growth_factor = float(cfg.growth_factor)
        self.backoff_factor = float(cfg.backoff_factor)
        self.growth_interval = cfg.growth_interval
        self.hysteresis = cfg.hysteresis
        self.min_scale = float(cfg.min_loss_scale)
        self.max_scale = float(cfg.max_loss_scale)
        self.scale: float = float(cfg.init_scale) if self.dynamic else float(cfg.loss_scale)
        self.growth_tracker = 0  # clean updates since the last change (Apex's "unskipped")
        self.hysteresis_left = self.hysteresis
        self.steps = 0  # updates, one per optimizer step this loss fed
        self.skipped = 0  # updates that found inf/NaN
        self.consecutive_skips = 0
        self.skips_at_min = 0  # consecutive overflows with the scale already at its floor
        #: ``(step, scale used, skipped)`` for the last ``HISTORY_LENGTH`` updates
        self.history: Deque[Tuple[int, float, bool]] = collections.deque(maxlen=HISTORY_LENGTH)

    @classmethod
    def from_config(cls, config: ScalerConfig) -> "LossScaler":
        """A scaler with ``config``'s form and dynamics."""
        return cls(config.loss_scale, **{k: getattr(config, k) for k in DEFAULTS})

    @property
    def active(self) -> bool:
        """Scaling does work (scale, unscale, check) only when active: dynamic,
        or a static scale other than 1.0 (whoever set it)."""
        return self.dynamic or self.scale != 1.0

    @property
    def at_min(self) -> bool:
        """True when an overflow can no longer lower the scale."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """Record one step's skip decision and move the scale accordingly.

        Example::

            scaler.update(found_inf=False)   # one clean step towards growth
        """
        self.history.append((self.steps, self.scale, bool(found_inf)))
        self.steps += 1
        if found_inf:
            self.skipped += 1
            self.consecutive_skips += 1
            self.skips_at_min = self.skips_at_min + 1 if self.at_min else 0
            if self.dynamic:
                self.growth_tracker = 0
                if self.hysteresis_left > 1:
                    self.hysteresis_left -= 1
                else:
                    self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.consecutive_skips = 0
        self.skips_at_min = 0
        self.growth_tracker += 1  # Apex's _unskipped counts a static scale's clean steps too
        if self.dynamic and self.growth_tracker >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.growth_tracker = 0
            self.hysteresis_left = self.hysteresis

    # ------------------------------------------------------------- state

    #: state_dict fields besides Apex's ``loss_scale`` and ``unskipped``
    _COUNTERS = ("hysteresis_left", "steps", "skipped", "consecutive_skips", "skips_at_min")

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to continue exactly, under Apex's names where Apex
        has one (``loss_scale``; ``unskipped`` is the growth tracker).

        Example::

            torch.save(scaler.state_dict(), "scaler.pt")
        """
        out: Dict[str, Any] = {"loss_scale": self.scale, "unskipped": self.growth_tracker}
        out.update((k, getattr(self, k)) for k in self._COUNTERS)
        out["dynamic"] = self.dynamic
        out["min_loss_scale"] = self.min_scale
        out["max_loss_scale"] = self.max_scale
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> List[str]:
        """Restore ``state_dict()`` output, or Apex's ``{"loss_scale", "unskipped"}``.

        Fields Apex does not have keep their defaults when absent. This
        scaler's policy always wins: a checkpoint of another policy (a BF16
        run's static scale of 1 loaded into a dynamic FP16 run, or the other
        way round) leaves the scale and growth state as they are and loads
        only the step counters; a dynamic scale outside this scaler's
        ``[min_loss_scale, max_loss_scale]`` is clamped into it.

        Returns:
            what was kept or changed against the checkpoint, one sentence
            each (empty when it loaded as saved), for the caller to report.

        Raises:
            ValueError: a field is missing or has the wrong type.

        Example::

            scaler.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})  # Apex's form
        """
        if not isinstance(state, dict):
            raise ValueError(f"a loss scaler state must be a dict, got {type(state).__name__}")
        if "loss_scale" not in state:
            raise ValueError(f"loss scaler state has no 'loss_scale' (keys: {sorted(map(str, state))})")
        scale = _number("loss_scale", state["loss_scale"])
        if scale <= 0:
            raise ValueError(f"loss scaler state has loss_scale={scale!r}; it must be > 0")
        saved_dynamic = state.get("dynamic")
        if saved_dynamic is not None and not isinstance(saved_dynamic, bool):
            raise ValueError(f"loss scaler state has dynamic={saved_dynamic!r}; it must be True or False")
        ints = {}
        defaults = {"unskipped": 0, "hysteresis_left": self.hysteresis}
        for k in ("unskipped",) + self._COUNTERS:
            v = state.get(k, defaults.get(k, 0))
            if hasattr(v, "item") and not isinstance(v, bool):  # a 0-dim tensor from an Apex checkpoint
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"loss scaler state has {k}={v!r}; it must be an integer >= 0")
            ints[k] = v
        kind = "dynamic" if self.dynamic else "static"
        if saved_dynamic is not None and saved_dynamic != self.dynamic:
            saved_kind = "dynamic" if saved_dynamic else "static"
            self.steps, self.skipped = ints["steps"], ints["skipped"]
            return [
                f"the checkpoint's loss scale is {saved_kind} ({scale:g}) and this run's is {kind}: kept this "
                f"run's {kind} scale {self.scale:g} and loaded only the step counters"
            ]
        notes = []
        if self.dynamic and not self.min_scale <= scale <= self.max_scale:
            clamped = min(max(scale, self.min_scale), self.max_scale)
            notes.append(
                f"the checkpoint's loss scale {scale:g} lies outside this run's [min_loss_scale, max_loss_scale] = "
                f"[{self.min_scale:g}, {self.max_scale:g}]: clamped to {clamped:g}"
            )
            scale = clamped
        self.scale = scale
        self.growth_tracker = ints.pop("unskipped")
        for k, v in ints.items():
            setattr(self, k, v)
        self.hysteresis_left = max(1, min(self.hysteresis_left, self.hysteresis))
        return notes

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, steps={self.steps}, skipped={self.skipped})"
