"""One session, one config: what a later ``initialize`` does with its own
options, ``enabled=False``, and the options that belong to the whole session."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch import ConfigError, amp as apex_amp

pytestmark = pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _pair():
    m = Net()
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.quick
def test_a_later_initialize_converts_its_own_models_with_its_own_options():
    # Before, the second call's options were checked and dropped: its model was
    # converted with the first call's keep_fp32 (which named a module it does
    # not have) and saved in the first call's save_dtype.
    m1, o1 = _pair()
    m2, o2 = _pair()
    amp_patch.initialize(m1, o1, "O3", half_dtype=torch.bfloat16, keep_fp32=["head"], verbosity=0)
    try:
        amp_patch.initialize(m2, o2, "O3", half_dtype=torch.bfloat16, keep_fp32=["body"], save_dtype="bfloat16", verbosity=0)
        assert m1.head.weight.dtype == torch.float32 and m1.body.weight.dtype == torch.bfloat16
        assert m2.body.weight.dtype == torch.float32 and m2.head.weight.dtype == torch.bfloat16
        assert m1.state_dict()["body.weight"].dtype == torch.float32
        assert m2.state_dict()["head.weight"].dtype == torch.bfloat16
    finally:
        amp_patch.deinitialize()


def test_a_later_initialize_without_keep_fp32_does_not_get_the_first_calls():
    m1, o1 = _pair()
    m2 = nn.Sequential(nn.Linear(4, 4))
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    amp_patch.initialize(m1, o1, "O2", half_dtype=torch.bfloat16, keep_fp32=["head"], verbosity=0)
    try:
        amp_patch.initialize(m2, o2, "O2", half_dtype=torch.bfloat16, verbosity=0)
        assert m2[0].weight.dtype == torch.bfloat16
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("option, value, running", [
    ("num_losses", 3, 1), ("min_loss_scale", 2.0, 1.0), ("collect_stats", True, False), ("verbosity", 0, 1),
])
def test_a_later_initialize_naming_a_different_session_option_is_refused_and_changes_nothing(option, value, running):
    m1, o1 = _pair()
    m2, o2 = _pair()
    amp_patch.initialize(m1, o1, "O2", half_dtype=torch.float16)
    try:
        with pytest.raises(ConfigError, match=rf"{option}={value!r} \(running: {running!r}\).*belong to the whole session"):
            amp_patch.initialize(m2, o2, "O2", half_dtype=torch.float16, **{option: value})
        assert m2.body.weight.dtype == torch.float32 and "step" not in vars(o2)
        assert not m2._forward_pre_hooks
        # the running value, or none at all, is accepted
        amp_patch.initialize(m2, o2, "O2", half_dtype=torch.float16, **{option: running} if running is not None else {})
        assert m2.body.weight.dtype == torch.float16
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_enabled_false_hands_everything_back_untouched(level):
    m, o = _pair()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = amp_patch.initialize(m, o, level, enabled=False)
    assert out[0] is m and out[1] is o
    assert not amp_patch.is_initialized()
    assert "step" not in vars(o) and not m._forward_pre_hooks
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in m.state_dict().items())


def test_op_lists_at_a_level_that_patches_no_functions_are_refused():
    m, o = _pair()
    with pytest.raises(ConfigError, match=r"lists= overrides the op lists, but opt_level='O2' patches no functions.*Use O1 or O4"):
        amp_patch.initialize(m, o, "O2", lists={"torch": {"float": ["mm"]}})
    assert not amp_patch.is_initialized() and m.body.weight.dtype == torch.float32


@pytest.mark.parametrize("option, value, why", [
    ("num_losses", 0, "must be an integer >= 1"),
    ("verbosity", "loud", "must be an integer >= 0"),
    ("fused_update", "yes", "must be True or False"),
    ("save_dtype", "float64", "is not supported"),
    ("keep_fp32", 3, "must be a callable"),
    ("growth_factor", 0.5, "must be > 1"),
])
def test_bad_options_are_refused_before_anything_changes(option, value, why):
    m, o = _pair()
    with pytest.raises(ConfigError, match=rf"{option}={value!r} {why}"):
        amp_patch.initialize(m, o, "O2", **{option: value})
    assert not amp_patch.is_initialized() and "step" not in vars(o)


def test_apex_load_state_dict_warns_at_the_callers_line():
    m, o = _pair()
    apex_amp.initialize(m, o, opt_level="O1", num_losses=2, verbosity=0, half_dtype=torch.float16)
    saved = apex_amp.state_dict()
    amp_patch.deinitialize()
    m, o = _pair()
    apex_amp.initialize(m, o, opt_level="O1", verbosity=0, half_dtype=torch.float16)
    try:
        with pytest.warns(amp_patch.AmpWarning) as rec:
            apex_amp.load_state_dict(saved)
        assert rec[0].filename == __file__
    finally:
        amp_patch.deinitialize()
