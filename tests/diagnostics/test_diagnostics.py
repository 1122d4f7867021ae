"""Warnings at initialize, and overflow provenance (find_overflow)."""
from __future__ import annotations

import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import diagnostics
from amp_patch.scaling.scaler import LossScaler
from amp_patch.base import running
from amp_patch.diagnostics import modes
from amp_patch.diagnostics import AmpWarning
from amp_patch.base.errors import StateError
from amp_patch.config import parse

f16, bf16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each warning is given once per process; every test starts afresh."""
    monkeypatch.setattr(diagnostics.notices, "_warned", set())


def _amp_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, AmpWarning)]


def _init_and_collect(*args, **kwargs):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        amp_patch.initialize(*args, **kwargs)
    return _amp_warnings(rec), rec


# ------------------------------------------------------------ warnings at initialize


def test_fp16_on_cpu_warns_once_and_points_at_the_callers_line():
    model = nn.Linear(4, 4)
    try:
        msgs, rec = _init_and_collect(model, opt_level="O1", half_dtype=f16)
    finally:
        amp_patch.deinitialize()
    assert msgs == [
        "amp_patch: O1 runs in float16 on the CPU, where FP16 kernels are few and slower than FP32. "
        "Use half_dtype=torch.bfloat16 on CPU (the default there), or move the model to a GPU."
    ]
    assert rec[0].filename == __file__
    try:
        again, _ = _init_and_collect(model, opt_level="O1", half_dtype=f16)
    finally:
        amp_patch.deinitialize()
    assert again == []


def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch):
    monkeypatch.setattr(diagnostics.setup_checks, "cpu_has_native_bf16", lambda: False)
    try:
        msgs, _ = _init_and_collect(nn.Linear(4, 4), opt_level="O1")
    finally:
        amp_patch.deinitialize()
    assert len(msgs) == 1
    assert "bfloat16 on a CPU without native BF16 instructions" in msgs[0]
    assert "slower than FP32" in msgs[0] and "opt_level='O0'" in msgs[0]


def test_bf16_on_a_cpu_with_native_bf16_is_quiet(monkeypatch):
    monkeypatch.setattr(diagnostics.setup_checks, "cpu_has_native_bf16", lambda: True)
    try:
        msgs, _ = _init_and_collect(nn.Linear(4, 4), opt_level="O1")
    finally:
        amp_patch.deinitialize()
    assert msgs == []


def test_o0_never_warns_about_speed():
    props = parse("O0", "cpu", half_dtype=f16)
    assert diagnostics.setup_checks.speed_warnings(props, "cpu", native_bf16=False) == []


def test_verbosity_0_is_silent():
    try:
        msgs, _ = _init_and_collect(nn.Linear(4, 4), opt_level="O1", half_dtype=f16, verbosity=0)
    finally:
        amp_patch.deinitialize()
    assert msgs == []


def test_fp16_over_bf16_weights_on_a_bf16_gpu():
    props = parse("O1", "cuda", half_dtype=f16)
    bf16_model = nn.Linear(4, 4).to(bf16)
    msgs = diagnostics.setup_checks.bf16_weights_warnings(props, "cuda", True, [nn.Linear(2, 2), bf16_model])
    assert msgs == [
        "amp_patch: half_dtype is float16, but model 1 (Linear) has bfloat16 weights and this GPU supports BF16; "
        "casting them to FP16 loses range (FP16 overflows above 65504) for no gain. "
        "Use half_dtype=torch.bfloat16 (or opt_level='O4' / 'O5')."
    ]
    assert diagnostics.setup_checks.bf16_weights_warnings(props, "cuda", False, [bf16_model]) == []  # no BF16 on this GPU
    assert diagnostics.setup_checks.bf16_weights_warnings(parse("O1", "cuda", half_dtype=bf16), "cuda", True, [bf16_model]) == []


def test_a_model_on_several_devices():
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(1, device="meta"))
    msgs = diagnostics.setup_checks.device_warnings(parse("O1", "cpu", half_dtype=None), [nn.Linear(2, 2), model])
    assert len(msgs) == 1
    assert msgs[0].startswith("amp_patch: model 1 (Linear) has tensors on several devices (cpu, meta)")


def test_optimizer_parameters_outside_the_models_warn_at_o1():
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    try:
        msgs, _ = _init_and_collect(a, opt, opt_level="O1", half_dtype=bf16)
    finally:
        amp_patch.deinitialize()
    stray = [m for m in msgs if "optimizer 0" in m]
    assert stray == [
        "amp_patch: optimizer 0 (SGD) updates 2 parameter(s) that are in none of the models passed to "
        "initialize. Pass every model it trains: amp_patch.initialize([model_a, model_b], optimizer, ...)."
    ]
    try:
        msgs, _ = _init_and_collect([a, b], opt, opt_level="O1", half_dtype=bf16)
    finally:
        amp_patch.deinitialize()
    assert not [m for m in msgs if "optimizer 0" in m]


@pytest.mark.quick
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_an_optimizer_over_part_of_a_master_weights_model_names_the_rest(level):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)  # frozen on purpose: not named
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    try:
        msgs, _ = _init_and_collect(model, opt, opt_level=level, half_dtype=bf16)
    finally:
        amp_patch.deinitialize()
    assert [m for m in msgs if "cover" in m] == [
        f"amp_patch: the optimizers given to initialize cover 2 of the 5 trainable parameters of model 0 "
        f"(Sequential); 1.weight, 1.bias, 2.bias are in none of them, so at {level} they stay bfloat16 with no FP32 "
        f"master and no step updates them. Pass every optimizer that trains the model (initialize(model, [opt1, "
        f"opt2], ...)), or set requires_grad=False on what you mean to freeze."
    ]
    whole = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        msgs, _ = _init_and_collect(model, whole, opt_level=level, half_dtype=bf16)
    finally:
        amp_patch.deinitialize()
    assert not [m for m in msgs if "cover" in m]


def _o3_adamw_step(eps, level="O3", half=f16):
    """One AdamW step of an initialized model whose second weight gets no gradient."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
    try:
        msgs, _ = _init_and_collect(model, opt, opt_level=level, half_dtype=half)
        model[0](torch.randn(2, 4, dtype=half)).float().sum().backward()  # model[1] gets no gradient...
        model[1].weight.grad = torch.zeros_like(model[1].weight)  # ...but a zero one, as after zero_grad
        opt.step()
        return msgs, torch.isfinite(model[1].weight.float()).all().item()
    finally:
        amp_patch.deinitialize()


def test_an_eps_that_is_zero_in_fp16_warns_at_o3_and_does_turn_weights_nan():
    msgs, finite = _o3_adamw_step(1e-8)
    assert not finite  # what the warning says happens
    assert [m for m in msgs if "eps" in m] == [
        "amp_patch: O3 keeps no FP32 master weights, so optimizer 0 (AdamW) steps float16 parameters "
        "itself, and its eps=1e-08 is 0 in float16: where a gradient is 0 or its square underflows (below "
        "about 2e-4), the update divides by 0 and the weight becomes inf or NaN. Use opt_level='O2' (FP32 "
        "master weights), or give the optimizer eps=1e-4 or more."
    ]


@pytest.mark.parametrize("eps,level,half", [(1e-4, "O3", f16), (1e-8, "O2", f16), (1e-8, "O3", bf16)])
def test_no_eps_warning_where_eps_survives_or_masters_are_fp32(eps, level, half):
    msgs, finite = _o3_adamw_step(eps, level, half)
    assert finite and not [m for m in msgs if "eps" in m]


@pytest.mark.quick
def test_functions_captured_before_initialize_are_named(tmp_path, monkeypatch):
    (tmp_path / "captured_mod.py").write_text(textwrap.dedent("""
        import torch.nn.functional as F           # a module: fine
        from torch.nn.functional import linear    # bound before initialize
        from torch import matmul as mm            # same, under another name
        from torch.nn.functional import dropout   # not patched: nothing to say
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "captured_mod", raising=False)
    import captured_mod  # noqa: F401

    try:
        msgs, _ = _init_and_collect(nn.Linear(4, 4), opt_level="O1", half_dtype=bf16)
        amp = running.session()
        assert not amp.patcher.is_patched(F, "dropout")
        found = diagnostics.setup_checks.captured_functions(amp.patcher)
    finally:
        amp_patch.deinitialize()
        sys.modules.pop("captured_mod", None)
    assert sorted(f for f in found if f[0] == "captured_mod") == [
        ("captured_mod", "linear", "torch.nn.functional.linear"),
        ("captured_mod", "mm", "torch.matmul"),
    ]
    assert (
        "amp_patch: captured_mod.linear is the original torch.nn.functional.linear, bound before "
        "amp_patch.initialize, so its calls are not cast. Call it through its module at call time "
        "(torch.nn.functional.linear(...)), or call initialize before importing captured_mod."
    ) in msgs
    assert any(m.startswith("amp_patch: captured_mod.mm is the original torch.matmul") for m in msgs)
    # torch's own modules hold these functions too; only user code is reported
    assert not any(mod.startswith("torch") for mod, _, _ in found)


def test_a_clip_function_captured_before_initialize_is_named_with_the_fix(tmp_path, monkeypatch):
    """``from torch.nn.utils import clip_grad_norm_`` then a loss-scaled run: that name
    would clip scaled gradients; the warning says so, once even when the module is
    also registered as __mp_main__ (multiprocessing's alias of __main__)."""
    (tmp_path / "clip_mod.py").write_text("from torch.nn.utils import clip_grad_norm_\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "clip_mod", raising=False)
    import clip_mod

    monkeypatch.setitem(sys.modules, "clip_alias", clip_mod)
    model = nn.Linear(4, 4)
    try:
        msgs, _ = _init_and_collect(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", half_dtype=f16)
    finally:
        amp_patch.deinitialize()
        sys.modules.pop("clip_mod", None)
    clip = [m for m in msgs if "clip_grad_norm_" in m]
    assert clip == [
        "amp_patch: clip_mod.clip_grad_norm_ is the original torch.nn.utils.clip_grad_norm_, bound before "
        "amp_patch.initialize, so it clips the loss-scaled gradients of the model, not the true ones of the "
        "optimizer. Clip amp_patch.master_params(optimizer), which are unscaled first, or call it through its "
        "module at call time (torch.nn.utils.clip_grad_norm_(...)), or call initialize before importing clip_mod."
    ]


# ------------------------------------------------------------ overflow provenance


class _Scaler(LossScaler):
    """A loss scaler whose history the test writes: ``on_skipped_step`` reads it."""

    def __init__(self):
        super().__init__()
        self.history = []


def _one_layer(weight: float, bias: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(8, 4))
    with torch.no_grad():
        model.fc.weight.fill_(weight)
        model.fc.bias.fill_(bias)
    return model


@pytest.fixture
def fp16_run(request):
    """O1 FP16 on CPU (FP16 is where values overflow) with a stand-in scaler."""
    model = _one_layer(*request.param)
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, find_overflow=True, verbosity=0)
    scaler = _Scaler()
    amp = running.session()
    amp.scaling.scalers.append(scaler)
    try:
        yield model, amp, scaler
    finally:
        amp_patch.deinitialize()


def _skip(amp, scaler, step=0):
    scaler.history.append((step, 65536.0, True))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        prov = diagnostics.on_skipped_step(amp.diagnostics, 0, scaler)
    return prov, _amp_warnings(rec), rec


@pytest.mark.parametrize("fp16_run", [(3000.0,)], indirect=True)
def test_forward_overflow_names_module_op_dtype_and_the_yaml_fix(fp16_run, tmp_path):
    model, amp, scaler = fp16_run
    x = torch.full((2, 8), 10.0)  # 8 * 10 * 3000 = 240000 > FP16's 65504
    F.mse_loss(model(x), torch.zeros(2, 4)).backward()
    prov, msgs, rec = _skip(amp, scaler)
    assert (prov.kind, prov.op, prov.module, prov.module_type, prov.dtype, prov.inputs_finite) == (
        "output", "torch.nn.functional.linear", "fc", "Linear", "float16", True
    )
    assert prov.step == 0 and prov.loss_id == 0
    assert prov.yaml == "torch.nn.functional:\n  float: [linear]\n"
    assert msgs == [str(prov)]
    assert rec[0].filename == __file__
    assert str(prov) == (
        "amp_patch: step 0 of loss 0 was skipped for inf/NaN gradients. The first non-finite value was the "
        "output of torch.nn.functional.linear in module 'fc' (Linear), computed in float16, from finite inputs.\n"
        "To run it in float32, add to an op-list override (initialize(..., lists='amp_fp32.yaml')):\n"
        "  torch.nn.functional:\n"
        "    float: [linear]"
    )
    assert amp_patch.report().to_dict()["overflow"]["op"] == "torch.nn.functional.linear"

    # The suggested override does fix it.
    amp_patch.deinitialize()
    (tmp_path / "fix.yaml").write_text(prov.yaml)
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, lists=str(tmp_path / "fix.yaml"), verbosity=0)
    out = model(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


class _Amplify(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * 1e5  # an operator: Tensor.__mul__ runs it


def _provenance_of_one_step(model, x, level):
    """find_overflow's verdict on one FP16 step of ``model`` at ``level``."""
    amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, half_dtype=f16,
                         find_overflow=True, verbosity=0)
    scaler = _Scaler()
    running.session().scaling.scalers.append(scaler)
    try:
        model(x).float().sum().backward()
        return _skip(running.session(), scaler)[0]
    finally:
        amp_patch.deinitialize()


def _output_under_o1_with(model, x, override, tmp_path):
    """The model's output at O1 FP16 with ``override`` (YAML text) as its op lists."""
    (tmp_path / "fix.yaml").write_text(override)
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, lists=str(tmp_path / "fix.yaml"), verbosity=0)
    try:
        return model(x)
    finally:
        amp_patch.deinitialize()


def test_an_operator_overflow_gets_an_override_that_reaches_the_operator(tmp_path):
    """``h * 1e5`` is seen as Tensor.mul but patched as __mul__: the suggested
    override names both, and it does run the product in float32."""
    torch.manual_seed(0)
    model = _Amplify()
    x = torch.ones(2, 8)
    prov = _provenance_of_one_step(model, x, "O1")
    assert (prov.kind, prov.op, prov.dtype) == ("output", "torch.Tensor.mul", "float16")
    assert prov.yaml == "torch.Tensor:\n  float: [mul, __mul__, __rmul__]\n"
    out = _output_under_o1_with(model, x, prov.yaml, tmp_path)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_at_o2_the_fix_names_what_works_at_that_level(tmp_path):
    """O2 runs the whole model in FP16, so an op list alone changes nothing there:
    the message says so and names keep_fp32, BF16, and O1 with the override."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Sequential(_one_layer(3000.0)))
    x = torch.full((2, 8), 10.0)
    prov = _provenance_of_one_step(model, x, "O2")
    assert (prov.op, prov.module, prov.dtype) == ("torch.nn.functional.linear", "1.0.fc", "float16")
    assert str(prov).endswith(
        "\nThis opt level runs the whole model in float16; op lists do not apply to it. "
        "initialize(..., keep_fp32=['1.0.fc']) runs that module in float32 (its output still returns to float16, "
        "so this helps when the overflow is inside it); half_dtype=torch.bfloat16 has float32's range; or "
        "opt_level='O1' runs only listed ops in float16 and takes this override (lists='amp_fp32.yaml'):\n"
        "  torch.nn.functional:\n    float: [linear]"
    )
    out = _output_under_o1_with(model, x, prov.yaml, tmp_path)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("fp16_run", [(0.001,)], indirect=True)
def test_forward_cast_overflow_is_named_as_the_cast_of_the_ops_input(fp16_run):
    model, amp, scaler = fp16_run
    model(torch.full((2, 8), 1e6))  # finite in FP32, inf once cast to FP16
    prov, _, _ = _skip(amp, scaler)
    assert (prov.kind, prov.op, prov.module, prov.dtype, prov.inputs_finite) == (
        "cast", "torch.nn.functional.linear", "fc", "float16", True
    )
    assert "came from casting an input of torch.nn.functional.linear in module 'fc' (Linear) to float16" in str(prov)
    assert prov.yaml == "torch.nn.functional:\n  float: [linear]\n"


@pytest.mark.parametrize("fp16_run", [(0.001,)], indirect=True)
def test_gradient_overflow_names_the_op_whose_backward_produced_it(fp16_run):
    model, amp, scaler = fp16_run
    x = torch.full((4, 8), 1000.0)
    out = model(x)  # about 8: finite
    assert torch.isfinite(out).all()
    # d(mse)/d(out) = 2 * 800 / 16 = 100, finite in FP16; the weight gradient
    # sums 4 rows of 100 * 1000 = 400000: beyond FP16.
    F.mse_loss(out, torch.full((4, 4), -800.0)).backward()
    prov, _, _ = _skip(amp, scaler)
    assert (prov.kind, prov.op, prov.module, prov.dtype, prov.inputs_finite) == (
        "gradient", "torch.nn.functional.linear", "fc", "float16", True
    )
    assert "came from the backward of torch.nn.functional.linear in module 'fc' (Linear), in float16" in str(prov)
    assert prov.yaml == "torch.nn.functional:\n  float: [linear]\n"


@pytest.mark.parametrize("fp16_run", [(0.01,)], indirect=True)
def test_a_scaled_gradient_overflowing_at_the_cast_back_to_fp16(fp16_run):
    model, amp, scaler = fp16_run
    out = model(torch.ones(4, 8))
    loss = F.mse_loss(out, torch.full((4, 4), 10.0))  # FP32: mse_loss is on the float list
    (loss * 65536.0).backward()  # a loss scale: 2 * 10 / 16 * 65536 = 81920 > 65504
    prov, _, _ = _skip(amp, scaler)
    assert (prov.kind, prov.op, prov.dtype) == ("cast_gradient", "torch.nn.functional.mse_loss", "float16")
    assert prov.yaml is None
    assert "That is the loss scale at work" in str(prov)


@pytest.mark.parametrize("fp16_run", [(0.01,)], indirect=True)
def test_nothing_non_finite_seen(fp16_run):
    model, amp, scaler = fp16_run
    F.mse_loss(model(torch.ones(2, 8)), torch.zeros(2, 4)).backward()
    prov, msgs, _ = _skip(amp, scaler)
    assert prov.kind is None and prov.op is None and prov.yaml is None
    assert "find_overflow saw no non-finite op output or gradient since it was armed" in msgs[0]


@pytest.mark.quick
def test_find_overflow_arms_one_step_then_disarms():
    model = _one_layer(3000.0)
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, verbosity=0)
    try:
        amp = running.session()
        scaler = _Scaler()
        amp.scaling.scalers.append(scaler)
        # Not armed: a skipped step is only logged.
        assert diagnostics.on_skipped_step(amp.diagnostics, 0, scaler) is None
        assert modes._observers == () and not model.fc._forward_hooks

        amp_patch.find_overflow()
        assert len(modes._observers) == 1 and model.fc._forward_hooks
        model(torch.full((2, 8), 10.0))
        prov, _, _ = _skip(amp, scaler, step=3)
        assert prov.step == 3 and prov.op == "torch.nn.functional.linear"
        # one step only: hooks and mode are gone
        assert modes._observers == () and not model.fc._forward_hooks
        assert torch._C._len_torch_function_stack() == 0
        assert diagnostics.on_skipped_step(amp.diagnostics, 0, scaler) is None
        assert amp_patch.report().overflow == prov  # still reported

        # Armed, but the step goes through: the next forward disarms it.
        amp_patch.find_overflow()
        model(torch.ones(2, 8))
        scaler.history.append((4, 65536.0, False))
        model(torch.ones(2, 8))
        assert modes._observers == () and not model.fc._forward_hooks
    finally:
        amp_patch.deinitialize()


def test_find_overflow_true_stays_armed_and_deinitialize_removes_it():
    model = _one_layer(3000.0)
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, find_overflow=True, verbosity=0)
    try:
        amp = running.session()
        scaler = _Scaler()
        amp.scaling.scalers.append(scaler)
        for step in range(2):
            model(torch.full((2, 8), 10.0))
            prov, _, _ = _skip(amp, scaler, step=step)
            assert prov.kind == "output" and prov.step == step
        assert len(modes._observers) == 1
    finally:
        amp_patch.deinitialize()
    assert modes._observers == () and not model.fc._forward_hooks and not model._forward_pre_hooks
    assert torch._C._len_torch_function_stack() == 0


def test_find_overflow_works_at_o2_style_half_models_too():
    # No function is patched; the watch still sees the ops a half model runs.
    model = _one_layer(3000.0).half()
    amp_patch.initialize(model, opt_level="O1", half_dtype=f16, patch_torch_functions=False,
                         find_overflow=True, verbosity=0)
    try:
        amp = running.session()
        scaler = _Scaler()
        amp.scaling.scalers.append(scaler)
        model(torch.full((2, 8), 10.0, dtype=f16))
        prov, _, _ = _skip(amp, scaler)
        assert (prov.kind, prov.op, prov.module, prov.dtype) == ("output", "torch.nn.functional.linear", "fc", "float16")
    finally:
        amp_patch.deinitialize()


def test_find_overflow_needs_initialize():
    with pytest.raises(StateError, match=r"amp_patch.find_overflow\(\) needs a running AMP"):
        amp_patch.find_overflow()


@pytest.mark.quick
def test_a_step_the_loss_scaler_skips_is_explained():
    model = _one_layer(3000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=f16, find_overflow=True, verbosity=0)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            opt.zero_grad()
            F.mse_loss(model(torch.full((2, 8), 10.0)), torch.zeros(2, 4)).backward()
            opt.step()  # inf/NaN gradients: the scaler skips the step and asks where they came from
        msgs = [m for m in _amp_warnings(rec) if "was skipped" in m]
        assert len(msgs) == 1
        assert msgs[0].startswith("amp_patch: step 0 of loss 0 was skipped for inf/NaN gradients. The first "
                                  "non-finite value was the output of torch.nn.functional.linear in module 'fc'")
        rep = amp_patch.report()
        assert rep.loss_scale[0]["skipped"] == 1 and rep.loss_scale[0]["skipped_steps"] == [0]
        assert rep.overflow.op == "torch.nn.functional.linear"
    finally:
        amp_patch.deinitialize()


def test_wrapt_without_its_c_extension_warns_where_functions_are_patched(monkeypatch):
    monkeypatch.delenv("WRAPT_DISABLE_EXTENSIONS", raising=False)
    o1, o2 = parse("O1", "cpu", half_dtype=None), parse("O2", "cpu", half_dtype=None)
    assert diagnostics.setup_checks.wrapt_has_c_extension()  # this environment's wrapt has it
    assert diagnostics.setup_checks.wrapper_warnings(o1, c_extension=True) == []
    assert diagnostics.setup_checks.wrapper_warnings(o2, c_extension=False) == []  # O2 patches no torch function
    (msg,) = diagnostics.setup_checks.wrapper_warnings(o1, c_extension=False)
    assert msg.startswith("amp_patch: wrapt's C extension is not in use (wrapt was installed without it)")
    assert msg.endswith("(pip install --force-reinstall wrapt).")
    monkeypatch.setattr(diagnostics.setup_checks, "wrapt_has_c_extension", lambda: False)
    try:
        msgs, _ = _init_and_collect(None, opt_level="O1", half_dtype=bf16)
    finally:
        amp_patch.deinitialize()
    assert msg in msgs
