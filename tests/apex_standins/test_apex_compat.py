"""apex.amp compatibility: `from amp_patch import amp` and the `apex` alias."""
from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import ConfigError, amp
from amp_patch.base import running
from amp_patch.frontends import alias
from helpers import unannotated

# apex.amp's public surface (apex/amp/__init__.py) and its signatures.
APEX_NAMES = (
    "init", "half_function", "float_function", "promote_function", "register_half_function",
    "register_float_function", "register_promote_function", "scale_loss", "disable_casts",
    "initialize", "state_dict", "load_state_dict", "master_params",
)
APEX_SIGNATURES = {
    "initialize": "(models, optimizers=None, enabled=True, opt_level='O1', cast_model_type=None, "
    "patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None, loss_scale=None, "
    "cast_model_outputs=None, num_losses=1, verbosity=1, min_loss_scale=None, max_loss_scale=16777216.0)",
    "scale_loss": "(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False)",
    "master_params": "(optimizer)",
    "state_dict": "(destination=None)",
    "load_state_dict": "(state_dict)",
    "register_half_function": "(module, name)",
    "register_float_function": "(module, name)",
    "register_promote_function": "(module, name)",
    "init": "(enabled=True, loss_scale='dynamic', enable_caching=True, verbose=False, allow_banned=False, *, half_dtype=None)",
}


@pytest.fixture(autouse=True)
def fresh_apex_flag(monkeypatch):
    # amp.initialize(enabled=False) is remembered module-wide, as in Apex.
    monkeypatch.setattr(amp, "_enabled", None)


@pytest.fixture
def net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step_loss(model):
    x = torch.randn(5, 4)
    return F.cross_entropy(model(x).float(), torch.tensor([0, 1, 2, 0, 1]))


# ------------------------------------------------------------------ surface


def test_every_apex_amp_name_is_there():
    missing = [n for n in APEX_NAMES if not callable(getattr(amp, n, None))]
    assert not missing


#: amp_patch's own keyword-only additions, after Apex's parameters
EXTENSIONS = {"initialize": ", *, half_dtype=None"}


@pytest.mark.parametrize("name", sorted(APEX_SIGNATURES))
def test_signatures_are_apexs(name):
    assert unannotated(getattr(amp, name)) == APEX_SIGNATURES[name][:-1] + EXTENSIONS.get(name, "") + ")"


def test_registration_and_casting_helpers_are_amp_patchs_own():
    for name in ("register_half_function", "register_float_function", "register_promote_function",
                 "half_function", "float_function", "promote_function", "disable_casts"):
        assert getattr(amp, name) is getattr(amp_patch, name), name


# ------------------------------------------------------------ enabled=False


def test_enabled_false_is_a_pass_through(net):
    model, opt = net
    linear = F.linear
    out_model, out_opt = amp.initialize(model, opt, enabled=False, opt_level="O1")
    assert out_model is model and out_opt is opt
    assert amp.initialize(model, enabled=False) is model
    assert not amp_patch.is_initialized() and F.linear is linear
    loss = step_loss(model)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}})  # ignored, as in Apex
    assert list(amp.master_params(opt)) == list(model.parameters())
    assert model[0](torch.randn(2, 4)).dtype == torch.float32


def test_initialize_after_enabled_false_enables(net):
    model, opt = net
    amp.initialize(model, opt, enabled=False)
    try:
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
        assert amp_patch.is_initialized()
        assert model[0](torch.randn(2, 4)).dtype == torch.bfloat16  # cast inside
        assert model(torch.randn(2, 4)).dtype == torch.float32  # FP32 outputs: cast_model_outputs
    finally:
        amp_patch.deinitialize()


# --------------------------------------------------------------- forwarding


def test_apex_property_overrides_reach_amp_patch(net):
    model, opt = net
    try:
        out = amp.initialize(model, opt, opt_level="o1", loss_scale="128.0", patch_torch_functions="True", verbosity=0)
        assert out == (model, opt)
        props = running.session().config
        assert props.opt_level == "O1" and props.loss_scale == 128.0 and props.patch_torch_functions
    finally:
        amp_patch.deinitialize()


def test_models_and_optimizers_keep_their_structure(net):
    model, opt = net
    try:
        models, opts = amp.initialize([model], [opt], opt_level="O4", verbosity=0)
        assert models == [model] and opts == [opt]
    finally:
        amp_patch.deinitialize()


def test_bad_input_raises_and_leaves_torch_alone(net):
    model, opt = net
    linear = F.linear
    with pytest.raises(ConfigError, match="opt_level='O9' is not an opt level"):
        amp.initialize(model, opt, opt_level="O9")
    with pytest.raises(ConfigError, match="loss_scale='huge'"):
        amp.initialize(model, opt, loss_scale="huge")
    assert not amp_patch.is_initialized() and F.linear is linear


def test_a_misspelled_keyword_names_the_nearest_valid_one(net):
    """Python's own TypeError says only that the keyword is unexpected; this one says which
    was meant, and is still a TypeError for code that catches one."""
    model, opt = net
    linear = F.linear
    with pytest.raises(TypeError, match=r"^amp.initialize\(\) got an unexpected keyword argument 'opt_levl'; "
                       r"did you mean 'opt_level'\?$") as info:
        amp.initialize(model, opt, opt_levl="O1")
    assert isinstance(info.value, amp_patch.AmpError)
    with pytest.raises(TypeError, match="'keep_batchnorm_fp23'; did you mean 'keep_batchnorm_fp32'"):
        amp.initialize(model, opt, opt_level="O2", keep_batchnorm_fp23=True)
    with pytest.raises(TypeError, match="'zzz'; it takes models, optimizers, enabled, opt_level, "):
        amp.initialize(model, opt, zzz=1)
    assert not amp_patch.is_initialized() and F.linear is linear


def test_master_params_before_initialize_are_the_optimizers_params(net):
    model, opt = net
    assert [id(p) for p in amp.master_params(opt)] == [id(p) for p in model.parameters()]


# ----------------------------------------------------- loss scaling, Apex's way


@pytest.fixture
def fp16_o1(net):
    model, opt = net
    amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, num_losses=2, verbosity=0)
    try:
        yield model, opt
    finally:
        amp_patch.deinitialize()


@pytest.mark.quick
def test_state_dict_is_apexs_format(fp16_o1):
    sd = amp.state_dict()
    assert {"loss_scaler0", "loss_scaler1"} <= set(sd)
    for key in ("loss_scaler0", "loss_scaler1"):
        assert float(sd[key]["loss_scale"]) == 2.0**16  # Apex's initial dynamic scale
        assert int(sd[key]["unskipped"]) == 0


@pytest.mark.quick
def test_scale_loss_scales_and_counts_an_unskipped_step(fp16_o1):
    model, opt = fp16_o1
    loss = step_loss(model)
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.float() * 2.0**16)
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=1.0)
    opt.step()
    assert int(amp.state_dict()["loss_scaler0"]["unskipped"]) == 1


def test_an_apex_checkpoint_loads(fp16_o1):
    model, opt = fp16_o1
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5},
                         "loss_scaler1": {"loss_scale": 64.0, "unskipped": 0}})
    sd = amp.state_dict()
    assert float(sd["loss_scaler0"]["loss_scale"]) == 128.0 and int(sd["loss_scaler0"]["unskipped"]) == 5
    assert float(sd["loss_scaler1"]["loss_scale"]) == 64.0
    loss = step_loss(model)
    with amp.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 64.0)
        scaled.backward()


def test_an_apex_checkpoint_with_another_number_of_losses_loads_as_in_apex(fp16_o1):
    """Apex warned and loaded the scalers that fit; amp_patch's own load_state_dict
    refuses the mismatch (all or nothing), naming num_losses."""
    three = {f"loss_scaler{i}": {"loss_scale": 2.0 ** (7 - i), "unskipped": i} for i in range(3)}
    with pytest.raises(ConfigError, match=r"the checkpoint has 3 loss scaler\(s\), this run has 2; pass initialize\(\.\.\., num_losses=3\)"):
        amp_patch.load_state_dict(three)
    with pytest.warns(UserWarning, match=r"has 3 loss scaler\(s\), this run has 2.*Loading the first 2, as apex.amp did"):
        amp.load_state_dict(three)
    sd = amp.state_dict()
    assert [float(sd[f"loss_scaler{i}"]["loss_scale"]) for i in range(2)] == [128.0, 64.0]
    with pytest.warns(UserWarning, match="Loading the first 1"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 16.0, "unskipped": 0}})
    sd = amp.state_dict()
    assert [float(sd[f"loss_scaler{i}"]["loss_scale"]) for i in range(2)] == [16.0, 64.0]


def test_editing_the_loss_scale_through_the_state_dict_works(fp16_o1):
    sd = amp.state_dict()
    sd["loss_scaler0"]["loss_scale"] = 1024.0
    amp.load_state_dict(sd)
    assert float(amp.state_dict()["loss_scaler0"]["loss_scale"]) == 1024.0


def test_state_dict_fills_a_given_destination(fp16_o1):
    dest = {"mine": 1}
    assert amp.state_dict(dest) is dest and dest["mine"] == 1 and "loss_scaler0" in dest


# -------------------------------------------------------------------- alias


@pytest.fixture
def clean_apex(monkeypatch, caplog):
    """No apex anywhere before and after; the 'says so once' flag reset."""
    monkeypatch.setattr(alias, "_announced", False)
    saved_path, saved_meta = list(sys.path), list(sys.meta_path)
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    caplog.set_level(logging.INFO, logger="amp_patch")
    yield caplog
    alias.remove_apex_alias()
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        del sys.modules[name]
    sys.path[:] = saved_path
    sys.meta_path[:] = saved_meta
    importlib.invalidate_caches()


def announcements(caplog):
    return [r for r in caplog.records if "resolves to amp_patch.amp" in r.getMessage()]


def test_alias_serves_apex_amp_when_apex_is_absent(clean_apex):
    assert amp_patch.install_apex_alias() is True
    assert amp_patch.install_apex_alias() is True  # harmless twice
    assert "apex" not in sys.modules  # nothing imported until the script asks
    import apex
    from apex import amp as apex_amp
    import apex.amp

    assert apex_amp is amp and apex.amp is amp and sys.modules["apex.amp"] is amp
    assert apex.amp.scale_loss is amp.scale_loss
    assert amp.__spec__.name == "amp_patch.amp"
    assert len(announcements(clean_apex)) == 1


@pytest.mark.quick
def test_alias_names_the_replacement_of_apex_modules_it_does_not_serve(clean_apex):
    amp_patch.install_apex_alias()
    with pytest.raises(ModuleNotFoundError, match=r"apex.contrib.fmha.*scaled_dot_product_attention"):
        import apex.contrib.fmha  # noqa: F401
    with pytest.raises(ImportError, match=r"apex.RNN.*nn.LSTM"):
        from apex.RNN import LSTM  # noqa: F401
    assert alias.replacement("apex.contrib.xentropy.SoftmaxCrossEntropyLoss").startswith(
        "use torch.nn.functional.cross_entropy(logits, target, label_smoothing=smoothing, ignore_index=padding_idx)")
    import apex

    with pytest.raises(AttributeError, match=r"transformer.*tensor.parallel"):
        apex.transformer


@pytest.mark.quick
def test_alias_serves_every_stand_in_under_apexs_names(clean_apex):
    amp_patch.install_apex_alias()
    import amp_C
    star = {}
    exec("from apex.fp16_utils import *", star)  # a script's star import
    from apex.fp16_utils import FP16_Optimizer as Fp16Opt
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply
    from apex.normalization.fused_layer_norm import FusedLayerNorm
    from apex.optimizers import FusedLAMB
    from apex.optimizers.fused_adam import FusedAdam
    from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model
    from apex.parallel.LARC import LARC
    import apex

    from amp_patch.apex import fp16_utils, multi_tensor_apply, normalization, optimizers, parallel
    from amp_patch.apex import amp_C as our_amp_C

    assert amp_C is our_amp_C and multi_tensor_applier is multi_tensor_apply.multi_tensor_applier
    assert MultiTensorApply is multi_tensor_apply.MultiTensorApply and Fp16Opt is fp16_utils.FP16_Optimizer
    assert FusedLayerNorm is normalization.FusedLayerNorm and FusedAdam is optimizers.FusedAdam
    assert FusedLAMB is optimizers.FusedLAMB and DDP is parallel.DistributedDataParallel
    assert LARC is parallel.LARC.LARC and apex.parallel.convert_syncbn_model is convert_syncbn_model
    assert parallel.__spec__.name == "amp_patch.apex.parallel"  # served, not re-run under the apex name
    assert star["to_python_float"] is fp16_utils.to_python_float and "network_to_half" in star
    alias.remove_apex_alias()
    assert not [m for m in sys.modules if m == "amp_C" or m == "apex" or m.startswith("apex.")]


def test_a_real_apex_keeps_its_modules_and_gains_the_missing_stand_ins(clean_apex, tmp_path):
    pkg = tmp_path / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "normalization.py").write_text("class FusedLayerNorm:\n    REAL = True\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    assert amp_patch.install_apex_alias() is True
    from apex.normalization import FusedLayerNorm
    from apex.parallel import DistributedDataParallel
    import apex

    assert FusedLayerNorm.REAL  # the real module stays in charge
    assert DistributedDataParallel.__module__ == "amp_patch.apex.parallel.distributed"
    alias.remove_apex_alias()
    assert "parallel" not in vars(apex) and "amp" not in vars(apex)


def test_alias_serves_apex_amps_private_modules_without_hiding_the_state(clean_apex):
    amp_patch.install_apex_alias()
    import apex.amp._amp_state
    import apex.amp.frontend
    from apex.amp._amp_state import _amp_state

    assert apex.amp._amp_state is _amp_state is amp._amp_state  # the object, as in Apex
    assert apex.amp.frontend._amp_state is _amp_state
    assert sys.modules["apex.amp._amp_state"].maybe_print is not None


def test_removing_the_alias_leaves_no_apex(clean_apex):
    amp_patch.install_apex_alias()
    import apex.amp  # noqa: F401

    alias.remove_apex_alias()
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules
    assert importlib.util.find_spec("apex") is None
    assert not alias.is_installed()


def test_a_real_apex_amp_is_left_in_charge(clean_apex, tmp_path):
    pkg = tmp_path / "apex"
    (pkg / "amp").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "amp" / "__init__.py").write_text("REAL = True\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    assert amp_patch.install_apex_alias() is False
    from apex import amp as apex_amp

    assert apex_amp is not amp and apex_amp.REAL
    assert not announcements(clean_apex)


def test_an_apex_without_amp_keeps_its_kernels_and_gains_amp(clean_apex, tmp_path):
    pkg = tmp_path / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("KERNELS = 'fused'\n")
    (pkg / "optimizers.py").write_text(textwrap.dedent("""
        class FusedAdam:
            pass
    """))
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    assert amp_patch.install_apex_alias() is True
    import apex
    from apex import amp as apex_amp
    from apex.optimizers import FusedAdam

    assert apex.KERNELS == "fused" and FusedAdam.__module__ == "apex.optimizers"
    assert apex_amp is amp and apex.amp is amp
    assert len(announcements(clean_apex)) == 1
    alias.remove_apex_alias()
    assert "amp" not in vars(apex)
