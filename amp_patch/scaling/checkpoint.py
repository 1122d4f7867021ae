"""amp_patch's checkpoint: ``state_dict`` / ``load_state_dict`` of the loss
scalers, and ``counters``."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

from .. import diagnostics
from ..base import running
from ..base.errors import ConfigError
from ..patching import attention
from .api import current
from .patches import ensure_patches
from .state import LossScaling

STATE_VERSION = 1


def state_dict(destination: Optional[dict] = None) -> dict:
    """amp_patch's state for a checkpoint: every loss scaler, the opt level, and
    under ``cast_policy="auto"`` the attention precisions chosen so far.

    The format is apex.amp's, ``{"loss_scaler0": {"loss_scale": ...,
    "unskipped": ...}, ...}``, each entry with the scaler's other counters
    added, plus ``"amp_patch": {"version", "opt_level", "half_dtype"}``. Save it
    next to ``model.state_dict()`` and ``optimizer.state_dict()``; loading all
    three after ``initialize`` resumes bit for bit.

    Args:
        destination: a dict to fill and return (apex.amp's argument).

    Example::

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp_patch.state_dict()}, "ckpt.pt")
    """
    amp = current("state_dict")
    out = {} if destination is None else destination
    for i, s in enumerate(amp.scaling.scalers):
        out[f"loss_scaler{i}"] = s.state_dict()
    out["amp_patch"] = {
        "version": STATE_VERSION,
        "opt_level": amp.config.opt_level,
        "half_dtype": str(amp.config.half_dtype).replace("torch.", ""),
    }
    if amp.config.cast_policy == "auto":
        # the resumed run takes these rather than measuring again: a near-tie
        # measured the other way would change what it computes
        out["amp_patch"]["attention"] = attention.saved()
    return out


def _scaler_entries(state: dict) -> List[Any]:
    keys = [k for k in state if isinstance(k, str) and k.startswith("loss_scaler")]
    ids = sorted(int(k[11:]) for k in keys if k[11:].isdigit())
    if not keys:
        raise ConfigError(
            f"amp_patch.load_state_dict: no loss scaler state in the dict (keys: {sorted(map(str, state))}); "
            f"pass what amp_patch.state_dict() (or apex.amp.state_dict()) returned"
        )
    if len(ids) != len(keys) or ids != list(range(len(ids))):
        raise ConfigError(f"amp_patch.load_state_dict: expected keys loss_scaler0..loss_scaler{len(keys) - 1}, got {sorted(keys)}")
    return [state[f"loss_scaler{i}"] for i in ids]


def load_state_dict(state: dict, *, strict: bool = True) -> None:
    """Restore ``state_dict()`` output, or apex.amp's (``{"loss_scaler0": {...}}``).

    Call it after ``initialize`` with the same ``num_losses``. All or
    nothing: a bad entry raises before any scaler changes.

    Args:
        state: what ``state_dict()`` returned.
        strict: False loads a checkpoint with another number of loss scalers
            as apex.amp did: a warning, then the first ``min(saved, num_losses)``
            scalers (``apex.amp.load_state_dict`` here uses it).

    Raises:
        StateError: before ``initialize``.
        ConfigError: malformed state, or (when strict) a different number of losses.

    Example::

        model, optimizer = amp_patch.initialize(model, optimizer, opt_level="O2")
        ckpt = torch.load("ckpt.pt")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        amp_patch.load_state_dict(ckpt["amp"])
    """
    amp = current("load_state_dict")
    if not isinstance(state, dict):
        raise ConfigError(f"amp_patch.load_state_dict expects the dict amp_patch.state_dict() returned, got {type(state).__name__}")
    entries = _scaler_entries(state)
    run = amp.scaling
    if len(entries) != len(run.scalers):
        message = (
            f"amp_patch.load_state_dict: the checkpoint has {len(entries)} loss scaler(s), this run has "
            f"{len(run.scalers)}; pass initialize(..., num_losses={len(entries)})"
        )
        if strict:
            raise ConfigError(message)
        diagnostics.warn_user(f"{message}. Loading the first {min(len(entries), len(run.scalers))}, as apex.amp did.")
    meta = state.get("amp_patch")
    level = meta.get("opt_level") if isinstance(meta, dict) else None
    half = meta.get("half_dtype") if isinstance(meta, dict) else None
    for i, (s, entry) in enumerate(zip(run.scalers, entries)):
        try:
            copy.deepcopy(s).load_state_dict(entry)
        except ValueError as e:
            raise ConfigError(f"amp_patch.load_state_dict: loss scaler {i}: {e}") from None
    choices = meta.get("attention") if isinstance(meta, dict) else None
    if choices is not None:
        try:
            attention.restore(choices)
        except ValueError as e:
            raise ConfigError(f"amp_patch.load_state_dict: {e}") from None
    notes: List[str] = []
    kept: List[str] = []
    loaded: List[str] = []
    ours = str(amp.config.half_dtype).replace("torch.", "")
    if half is not None and half != ours:
        notes.append(f"the checkpoint was saved by a {half} run and this run is {ours}")
        kept.append(f"this run's half dtype, {ours}")
    if level is not None and level != amp.config.opt_level:
        notes.append(f"the checkpoint was saved at opt_level={level!r} and this run is {amp.config.opt_level!r}")
        kept.append(f"this run's opt_level, {amp.config.opt_level!r}")
    for i, (s, entry) in enumerate(zip(run.scalers, entries)):
        said = s.load_state_dict(entry)
        notes += [f"loss scaler {i}: {n}" for n in said]
        counts = f"step counters ({s.steps} steps, {s.skipped} skipped)"
        saved_dynamic = entry.get("dynamic")
        if saved_dynamic is not None and saved_dynamic != s.dynamic:
            kind = "dynamic" if s.dynamic else "static"
            kept.append(f"loss scaler {i}'s {kind} scale {s.scale:g}")
            loaded.append(f"loss scaler {i}'s {counts}")
        elif said:  # the saved scale, clamped into this run's range
            kept.append(f"loss scaler {i}'s range [{s.min_scale:g}, {s.max_scale:g}]")
            loaded.append(f"loss scaler {i}'s scale (as {s.scale:g}) and {counts}")
        else:
            loaded.append(f"loss scaler {i}'s scale {s.scale:g} and {counts}")
    if choices is not None:
        loaded.append("the attention precisions chosen so far")
    if notes:
        diagnostics.warn_user("amp_patch.load_state_dict: " + "; ".join(notes) + ". Kept: " + "; ".join(kept)
                              + ". Loaded: " + "; ".join(loaded) + ".")
    ensure_patches(amp.scaling)  # a static scale of 1 may have become another


def counters() -> Dict[str, Any]:
    """Steps taken and skipped, and each loss's scale; after ``deinitialize``,
    the last run's.

    Returns:
        ``{"steps": int, "skipped": int, "loss_scale": [float per loss],
        "losses": [{"loss_scale", "dynamic", "steps", "skipped", "growth_tracker"}],
        "optimizers": [{"steps", "skipped", "fused", "one_pass"}]}``; ``steps`` and
        ``skipped`` sum the optimizers' ``step()`` calls that ran and that
        were skipped; ``fused`` counts the steps the compiled fused update ran
        (under ``fused_update=True``), ``one_pass`` those the one-pass C step
        ran (O2/O5, by default); the rest were plain O2 steps. A loss whose
        scale is inactive (BF16, a static 1.0) counts its steps too.

    Raises:
        StateError: no run has started yet.

    Example::

        c = amp_patch.counters()
        print(f"skipped {c['skipped']} of {c['steps'] + c['skipped']} steps; scale {c['loss_scale'][0]:g}")
    """
    last = running.last_ended()
    if running.session() is None and last is not None:
        return copy.deepcopy(last.counters)  # the caller may edit its copy
    return counters_of(current("counters").scaling)


def counters_of(run: LossScaling) -> Dict[str, Any]:
    """``counters()`` of a session's loss scaling (reads what the device counted: one wait)."""
    opts = [{"steps": h.steps, "skipped": h.skipped, "fused": h.compiled.steps if h.compiled is not None else 0,
             "one_pass": h.onepass.steps if h.onepass is not None else 0}
            for h in run.handles]
    return {
        "steps": sum(o["steps"] for o in opts),
        "skipped": sum(o["skipped"] for o in opts),
        "loss_scale": [s.scale for s in run.scalers],
        "losses": [
            {"loss_scale": s.scale, "dynamic": s.dynamic, "steps": s.steps, "skipped": s.skipped,
             "growth_tracker": s.growth_tracker}
            for s in run.scalers
        ],
        "optimizers": opts,
    }
