"""O6/O7 where torchao need not be installed: the options and their refusals,
the error that names the missing extra, and O7's optimizer-state codec
(``precision.lowstate``) on plain torch optimizers."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch import config
from amp_patch.base.errors import ConfigError
from amp_patch.precision import fp8, lowstate

pytestmark = pytest.mark.quick  # every test here is fast

bf16, f32, e4m3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


# ------------------------------------------------------------------ options


def test_o6_and_o7_are_o5_with_fp8():
    for level, depth in (("O6", 1), ("O7", 2)):
        c = config.parse(level, "cuda")
        assert c.fp8_level == depth and c.half_dtype == bf16 and c.cast_model_type == bf16 and c.master_weights
        assert c.fp8_recipe == "tensorwise" and c.fp8_layers == "auto" and c.loss_scale == 1.0
    assert config.parse("O5", "cpu").fp8_level == 0
    assert config.parse("o7", "cpu", fp8_layers="blocks.*", fp8_recipe="rowwise").fp8_layers == ("blocks.*",)


def test_fp8_options_are_refused_where_there_is_no_fp8_and_bad_values_everywhere():
    with pytest.raises(ConfigError, match="fp8_recipe= .*only O6 and O7.*opt_level='O5'"):
        config.parse("O5", "cpu", fp8_recipe="rowwise")
    with pytest.raises(ConfigError, match="fp8_layers="):
        config.parse("O1", "cpu", fp8_layers="all")
    with pytest.raises(ConfigError, match="'tensorwise', 'rowwise'"):
        config.parse("O6", "cpu", fp8_recipe="blockwise")
    with pytest.raises(ConfigError, match="module-name patterns"):
        config.parse("O6", "cpu", fp8_layers=3)


def test_without_torchao_an_fp8_level_says_what_to_install_and_changes_nothing(monkeypatch):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an import sees where torchao is not installed
    monkeypatch.setattr(fp8, "_tao", None)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
    with pytest.raises(ConfigError, match=r"torchao is not installed.*pip install -e '\.\[fp8\]'.*torchao==0\.18\.0"):
        amp_patch.initialize(model, torch.optim.AdamW(model.parameters()), "O6", verbosity=0)
    assert not amp_patch.is_initialized() and {p.dtype for p in model.parameters()} == {f32}
    assert config.parse("O6", "cpu").fp8_level == 1  # parsing needs no torchao


# ------------------------------------------------------------------ O7's codec


@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1.0, 3e4, 1e30])
def test_the_fp8_moment_uses_e4m3s_top_binade_and_encodes_its_own_decoding_exactly(magnitude):
    x = torch.randn(257, generator=torch.Generator().manual_seed(0)) * magnitude
    payload, scale = lowstate.encode(x)
    assert payload.dtype == e4m3 and scale.dtype == f32 and scale.dim() == 0
    assert torch.log2(scale) == torch.round(torch.log2(scale))  # a power of two
    assert 224 <= payload.float().abs().max() <= 448
    y = lowstate.decode(payload, scale)
    assert torch.allclose(y, x, rtol=0.07, atol=magnitude * 2**-8)  # 3 mantissa bits
    assert torch.equal(lowstate.decode(*lowstate.encode(y)), y)  # encoding again changes nothing


def test_zeros_and_empty_tensors_encode():
    p, s = lowstate.encode(torch.zeros(4))
    assert float(s) == 1.0 and torch.equal(lowstate.decode(p, s), torch.zeros(4))
    p, s = lowstate.encode(torch.zeros(0))
    assert p.numel() == 0 and float(s) == 1.0


def _train(opt, model, steps):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def test_the_state_codec_on_a_plain_adam_keeps_moments_small_and_checkpoints_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    _train(opt, model, 1)  # state from before: encoded at the start
    full = lowstate.state_bytes(opt)
    codec = lowstate.LowPrecisionState(opt)
    codec.start()
    _train(opt, model, 3)
    st = opt.state[model[0].weight]
    assert (st["exp_avg"].dtype, st["exp_avg_sq"].dtype, st["max_exp_avg_sq"].dtype) == (e4m3, bf16, bf16)
    assert lowstate.state_bytes(opt) < 0.45 * full
    sd = opt.state_dict()
    assert all(v.dtype == f32 for s in sd["state"].values() for k, v in s.items() if k != "step")
    assert all("exp_avg_scale" not in s for s in sd["state"].values())
    plain = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    plain.load_state_dict(sd)  # a checkpoint any Adam loads
    opt.load_state_dict(sd)  # and loads back encoded, to the same values
    assert opt.state[model[0].weight]["exp_avg"].dtype == e4m3
    assert torch.equal(lowstate.unpack(opt.state[model[0].weight])["exp_avg"], sd["state"][0]["exp_avg"])
    codec()  # the undo: hooks off, moments FP32
    assert opt.state[model[0].weight]["exp_avg"].dtype == f32 and not opt._optimizer_step_pre_hooks
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], sd["state"][0]["exp_avg"])


def test_the_bf16_second_moment_never_flushes_to_zero():
    v = torch.tensor([1e-38, 1e-20, 1.0, 1e20])
    state = {"exp_avg_sq": v.clone()}
    lowstate.pack(state)
    assert state["exp_avg_sq"].dtype == bf16 and bool((lowstate.unpack(state)["exp_avg_sq"] > 0).all())


def test_training_with_the_codec_follows_fp32_adam():
    def run(codec):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if codec:
            lowstate.LowPrecisionState(opt).start()
        _train(opt, model, 100)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        return F.mse_loss(model(x), y).item()

    assert run(True) == pytest.approx(run(False), rel=0.05)
