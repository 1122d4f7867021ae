"""The loss scaler: one explicit state machine per loss.

A ``LossScaler`` holds the scale as a Python float and changes it only in
``update(found_inf)``, which the step logic calls once per step with the
overflow skip decision for that loss, read on the host (one sync per step).

Sync-free stepping (``to_device``) moves the state onto the device: the
scale, its inverse, the growth tracker and the hysteresis count are 0-d
tensors, and ``update_device(found)`` moves them with device ops
(``torch._amp_update_scale_``, as ``torch.amp.GradScaler`` does), so no step
waits for the device. Each update also posts a small record (verdict, scale
before and after, trackers) to a host mirror, copied without blocking; the
host fields (``scale``, ``skipped``, ``history``, ...) replay those records
as they arrive (``poll``), and a read of one of them waits for the records
still in flight: counters sync when asked, not every step. ``steps`` counts
updates on the host and never waits.

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
from typing import Any, Deque, Dict, List, Optional, Tuple, Union

import torch

from ..base.counts import HostCopies
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
        self.device: Optional[_OnDevice] = None  # the state on the device (``to_device``), or None
        self._scale: float = float(cfg.init_scale) if self.dynamic else float(cfg.loss_scale)
        self._growth_tracker = 0  # clean updates since the last change (Apex's "unskipped")
        self._hysteresis_left = self.hysteresis
        self.steps = 0  # updates, one per optimizer step this loss fed (counted on the host: never waits)
        self._skipped = 0  # updates that found inf/NaN
        self._consecutive_skips = 0
        self._skips_at_min = 0  # consecutive overflows with the scale already at its floor
        #: ``(step, scale used, skipped)`` for the last ``HISTORY_LENGTH`` updates
        self._history: Deque[Tuple[int, float, bool]] = collections.deque(maxlen=HISTORY_LENGTH)

    @classmethod
    def from_config(cls, config: ScalerConfig) -> "LossScaler":
        """A scaler with ``config``'s form and dynamics."""
        return cls(config.loss_scale, **{k: getattr(config, k) for k in DEFAULTS})

    # The host view. Under ``to_device`` a read waits for the device's updates
    # still in flight (a sync when asked); a write reaches the device too.
    def _host(name: str, doc: str):  # type: ignore[misc]  # a property factory, used in the class body only
        attr = "_" + name

        def get(self: "LossScaler") -> Any:
            if self.device is not None and self.device.mirror:
                self.poll(wait=True)
            return getattr(self, attr)

        def put(self: "LossScaler", value: Any) -> None:
            if self.device is not None:
                self.poll(wait=True)
            setattr(self, attr, value)
            if self.device is not None:
                self.device.load(self)

        return property(get, put, doc=doc)

    scale = _host("scale", "The loss scale (a float).")
    growth_tracker = _host("growth_tracker", "Clean updates since the scale last changed.")
    hysteresis_left = _host("hysteresis_left", "Overflows still tolerated before backing off.")
    skipped = _host("skipped", "Updates that found inf/NaN.")
    consecutive_skips = _host("consecutive_skips", "Updates in a row that found inf/NaN.")
    skips_at_min = _host("skips_at_min", "Consecutive overflows with the scale already at its floor.")
    history = _host("history", "``(step, scale used, skipped)`` of the last ``HISTORY_LENGTH`` updates.")
    del _host

    @property
    def active(self) -> bool:
        """Scaling does work (scale, unscale, check) only when active: dynamic,
        or a static scale other than 1.0 (whoever set it). Never waits: a
        static scale changes only when set on the host."""
        return self.dynamic or self._scale != 1.0

    @property
    def at_min(self) -> bool:
        """True when an overflow can no longer lower the scale."""
        return not self.dynamic or self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """Record one step's skip decision and move the scale accordingly.

        Example::

            scaler.update(found_inf=False)   # one clean step towards growth
        """
        if self.device is not None:
            self.poll(wait=True)
        self._update_host(found_inf)
        if self.device is not None:
            self.device.load(self)

    def _update_host(self, found_inf: bool) -> None:
        self._history.append((self.steps, self._scale, bool(found_inf)))
        self.steps += 1
        if found_inf:
            self._skipped += 1
            self._consecutive_skips += 1
            self._skips_at_min = self._skips_at_min + 1 if self._at_min(self._scale) else 0
            if self.dynamic:
                self._growth_tracker = 0
                if self._hysteresis_left > 1:
                    self._hysteresis_left -= 1
                else:
                    self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._consecutive_skips = 0
        self._skips_at_min = 0
        self._growth_tracker += 1  # Apex's _unskipped counts a static scale's clean steps too
        if self.dynamic and self._growth_tracker >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, self.max_scale)
            self._growth_tracker = 0
            self._hysteresis_left = self.hysteresis

    def _at_min(self, scale: float) -> bool:
        return not self.dynamic or scale <= self.min_scale

    # ------------------------------------------------------------- on the device

    def to_device(self, device: torch.device) -> None:
        """Keep the state on ``device`` from now on (sync-free stepping): see the module docstring."""
        if self.device is None or self.device.where != device:
            self.poll(wait=True)
            self.device = _OnDevice(device)
            self.device.load(self)

    def to_host(self) -> None:
        """Keep the state on the host again (the host fields take every update first)."""
        if self.device is not None:
            self.poll(wait=True)
            self.device = None

    def seen(self, name: str) -> Any:
        """A host field as the records that have arrived leave it, without waiting."""
        return getattr(self, "_" + name)

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale as a 0-d FP32 tensor on ``device`` (under ``to_device``), without waiting."""
        return self.device.on(self.device.scale, device)  # type: ignore[union-attr]

    def inv_tensor(self, device: torch.device) -> torch.Tensor:
        """``1 / scale`` as a 0-d FP32 tensor on ``device`` (under ``to_device``), without waiting."""
        return self.device.on(self.device.inv, device)  # type: ignore[union-attr]

    def update_device(self, found: torch.Tensor) -> None:
        """``update`` with the verdict ``found`` (a 0-d FP32 tensor, 1.0 for an
        overflow) on the device: the scale moves there, with no host sync, and
        the record of the update reaches the host fields later (``poll``)."""
        d = self.device
        assert d is not None, "update_device needs to_device first"
        self.steps += 1
        before = d.scale.clone()
        if self.dynamic:
            if self.hysteresis == 1:
                torch._amp_update_scale_(d.scale, d.growth, found, self.growth_factor, self.backoff_factor,
                                         self.growth_interval)
            else:
                self._hysteresis_update(found)
            d.scale.clamp_(self.min_scale, self.max_scale)
            # as the host divides: 1 / scale in double, rounded once to FP32
            d.inv.copy_(d.scale.double().reciprocal())
        else:
            d.growth.add_(found.eq(0).to(torch.int32))  # a static scale's clean steps, as on the host
        d.mirror.post(torch.stack([found.float(), before, d.scale, d.growth.float(), d.hyst.float()]))

    def _hysteresis_update(self, found: torch.Tensor) -> None:
        """DeepSpeed's hysteresis (``update``'s rule) in device ops."""
        d = self.device
        bad = found > 0
        grown = d.growth + 1
        grow = grown.ge(self.growth_interval).logical_and_(bad.logical_not())
        back = bad.logical_and(d.hyst.le(1))
        scale = torch.where(back, d.scale * self.backoff_factor,
                            torch.where(grow, d.scale * self.growth_factor, d.scale))
        hyst = torch.where(bad.logical_and(d.hyst.gt(1)), d.hyst - 1,
                           torch.where(grow, torch.full_like(d.hyst, self.hysteresis), d.hyst))
        d.growth.copy_(torch.where(bad.logical_or(grow), torch.zeros_like(grown), grown))
        d.hyst.copy_(hyst)
        d.scale.copy_(scale)

    def poll(self, wait: bool = False) -> List[Tuple[float, float]]:
        """Bring the host fields up to date with the device's updates that have
        reached the host (all of them, waiting, when ``wait``). Returns ``(scale
        before, scale after)`` of each overflow replayed, for the caller's notices."""
        d = self.device
        if d is None:
            return []
        overflows = []
        for found, before, after, growth, hyst in d.mirror.drain(wait):
            bad = found > 0
            self._history.append((self.steps - len(d.mirror) - 1, before, bad))
            if bad:
                self._skipped += 1
                self._consecutive_skips += 1
                self._skips_at_min = self._skips_at_min + 1 if self._at_min(before) else 0
                overflows.append((before, after))
            else:
                self._consecutive_skips = 0
                self._skips_at_min = 0
            self._scale, self._growth_tracker, self._hysteresis_left = after, int(growth), int(hyst)
        return overflows

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


class _OnDevice:
    """A scaler's state as 0-d tensors on one device, and its host mirror."""

    def __init__(self, where: torch.device):
        self.where = where
        self.scale = torch.zeros((), dtype=torch.float32, device=where)
        self.inv = torch.zeros((), dtype=torch.float32, device=where)
        self.growth = torch.zeros((), dtype=torch.int32, device=where)
        self.hyst = torch.zeros((), dtype=torch.int32, device=where)
        self.mirror = HostCopies()
        self.copies: Dict[torch.device, Tuple[int, torch.Tensor, torch.Tensor]] = {}

    def load(self, s: LossScaler) -> None:
        """Take the host fields (after a host-side change): device ops, no wait."""
        self.scale.fill_(s._scale)
        self.inv.fill_(1.0 / s._scale)
        self.growth.fill_(s._growth_tracker)
        self.hyst.fill_(s._hysteresis_left)

    def on(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device``: itself at home, else a copy made without blocking."""
        if device == self.where or (device.type == self.where.type and device.index is None):
            return t
        return t.to(device, non_blocking=True)
