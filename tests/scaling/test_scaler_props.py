"""Property tests: the LossScaler state machine against a small reference model."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_patch.scaling.scaler import LossScaler

configs = st.fixed_dictionaries(
    {
        "init_scale": st.sampled_from([1.0, 8.0, 2.0**10, 2.0**16]),
        "growth_factor": st.sampled_from([1.5, 2.0, 4.0]),
        "backoff_factor": st.sampled_from([0.25, 0.5, 0.75]),
        "growth_interval": st.integers(1, 5),
        "hysteresis": st.integers(1, 3),
        "min_loss_scale": st.sampled_from([2.0**-4, 1.0]),
        "max_loss_scale": st.sampled_from([2.0**16, 2.0**24]),
    }
)
verdicts = st.lists(st.booleans(), max_size=60)


def reference(cfg, found_seq):
    """The documented rules, written out plainly: (scale, skipped) after each step."""
    scale = cfg["init_scale"]
    good = 0
    hyst = cfg["hysteresis"]
    out = []
    for found in found_seq:
        if found:
            good = 0
            if hyst > 1:
                hyst -= 1
            else:
                scale = max(scale * cfg["backoff_factor"], cfg["min_loss_scale"])
        else:
            good += 1
            if good == cfg["growth_interval"]:
                scale = min(scale * cfg["growth_factor"], cfg["max_loss_scale"])
                good = 0
                hyst = cfg["hysteresis"]
        out.append(scale)
    return out


@settings(max_examples=200, deadline=None)
@given(configs, verdicts)
def test_dynamic_scaler_matches_the_reference(cfg, found_seq):
    if not cfg["min_loss_scale"] <= cfg["init_scale"] <= cfg["max_loss_scale"]:
        return
    s = LossScaler("dynamic", **cfg)
    expected = reference(cfg, found_seq)
    for i, found in enumerate(found_seq):
        before = s.scale
        s.update(found)
        assert s.scale == expected[i]
        assert s.history[-1] == (i, before, found)
        assert cfg["min_loss_scale"] <= s.scale <= cfg["max_loss_scale"]
    assert s.steps == len(found_seq)
    assert s.skipped == sum(found_seq)
    run = 0
    for f in reversed(found_seq):
        if not f:
            break
        run += 1
    assert s.consecutive_skips == run


@settings(max_examples=100, deadline=None)
@given(configs, verdicts, verdicts)
def test_state_dict_round_trip_continues_identically(cfg, first, second):
    if not cfg["min_loss_scale"] <= cfg["init_scale"] <= cfg["max_loss_scale"]:
        return
    a = LossScaler("dynamic", **cfg)
    for f in first:
        a.update(f)
    b = LossScaler("dynamic", **cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for f in second:
        a.update(f)
        b.update(f)
        assert (a.scale, a.growth_tracker, a.hysteresis_left) == (b.scale, b.growth_tracker, b.hysteresis_left)
    assert a.state_dict() == b.state_dict()


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([0.5, 2.0, 128.0]), verdicts)
def test_static_scaler_never_moves_and_counts_skips(scale, found_seq):
    s = LossScaler(scale)
    for f in found_seq:
        s.update(f)
    assert s.scale == scale
    assert s.active
    assert s.skipped == sum(found_seq)
    # a static scale is always at its floor: every trailing overflow counts
    assert s.skips_at_min == s.consecutive_skips


@settings(max_examples=100, deadline=None)
@given(verdicts)
def test_skips_at_min_counts_only_overflows_at_the_floor(found_seq):
    s = LossScaler("dynamic", init_scale=4.0, min_loss_scale=1.0)
    at_min_run = 0
    for f in found_seq:
        floor = s.scale <= 1.0
        s.update(f)
        at_min_run = at_min_run + 1 if (f and floor) else 0
        assert s.skips_at_min == at_min_run


@pytest.mark.quick
def test_static_one_is_inactive():
    assert not LossScaler(1.0).active
    assert LossScaler("dynamic").active and LossScaler(2.0).active


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=2.0), "backoff_factor"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(init_scale=float("inf")), "init_scale"),
        (dict(min_loss_scale=0.0), "min_loss_scale"),
        (dict(max_loss_scale=0.5), "max_loss_scale"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(init_scale=2.0**30), "init_scale"),
    ],
)
def test_bad_values_raise_value_error_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LossScaler("dynamic", **kwargs)


def test_negative_static_scale_is_refused():
    with pytest.raises(ValueError, match="loss_scale"):
        LossScaler(-4.0)


def test_apex_state_loads_and_bad_state_is_refused():
    s = LossScaler("dynamic")
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})
    assert (s.scale, s.growth_tracker) == (1024.0, 7)
    with pytest.raises(ValueError, match="loss_scale"):
        s.load_state_dict({"unskipped": 1})
    with pytest.raises(ValueError, match="unskipped"):
        s.load_state_dict({"loss_scale": 2.0, "unskipped": -1})
    assert (s.scale, s.growth_tracker) == (1024.0, 7)


@pytest.mark.quick
def test_history_is_bounded():
    from amp_patch.scaling import scaler as mod

    s = LossScaler("dynamic")
    for _ in range(mod.HISTORY_LENGTH + 5):
        s.update(False)
    assert len(s.history) == mod.HISTORY_LENGTH
    assert s.history[-1][0] == mod.HISTORY_LENGTH + 4
