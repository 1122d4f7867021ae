"""The patching engine: initialize/deinitialize, wrappers, cache, switches."""
from __future__ import annotations

import re
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import wrapt

import amp_patch
from helpers import Snapshot
from amp_patch import ConfigError

HALVES = [torch.float16, torch.bfloat16]


@pytest.fixture
def o1(wrapper_path):
    """Start O1 with the given half dtype, once with the C wrapper types and once
    with the pure-Python ones; always deinitialize."""
    started = []

    def start(half=torch.bfloat16, **kw):
        out = amp_patch.initialize(None, None, "O1", half_dtype=half, **kw)
        started.append(True)
        return out

    yield start
    amp_patch.deinitialize()


def test_wrapt_c_extension_is_in_use():
    # Without it a Tensor-method wrapper costs microseconds more per call.
    assert wrapt.FunctionWrapper.__module__ in ("wrapt._wrappers", "builtins") or "_wrappers" in repr(
        wrapt.FunctionWrapper.__init__
    )
    import wrapt.wrappers as pure

    assert wrapt.FunctionWrapper is not getattr(pure, "FunctionWrapper", None)


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_roundtrip_restores_every_namespace_exactly(half):
    before = Snapshot()
    amp_patch.initialize(None, None, "O1", half_dtype=half)
    during = Snapshot()
    assert during["torch.nn.functional"]["linear"] is not before["torch.nn.functional"]["linear"]
    assert "mm" in during["torch.Tensor"] and "mm" not in before["torch.Tensor"]
    amp_patch.deinitialize()
    after = Snapshot()
    for name in before:
        assert before[name].keys() == after[name].keys(), name
        changed = [k for k in before[name] if before[name][k] is not after[name][k]]
        assert not changed, (name, changed)


@pytest.mark.quick
def test_deinitialize_when_nothing_patched_is_a_noop():
    before = Snapshot()
    amp_patch.deinitialize()
    amp_patch.deinitialize()
    assert before.changed() == []


def _clip_functions():
    import torch.nn.utils.clip_grad as cg

    return {(owner.__name__, n): getattr(owner, n) for owner in (torch.nn.utils, cg) for n in dir(owner) if n.startswith("clip_")}


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_levels_without_casts_or_scaling_patch_nothing_on_torch(level):
    """O0 (FP32) and O3 (half model, static scale 1) have nothing to do in
    torch's functions: no namespace, not Tensor.backward, not clip_grad_norm_.
    (O3's one patch on a CPU, attention in FP32 where faster, is its
    ``cast_policy="auto"``: tests/patching/test_attention_policy.py; here it is off.)"""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(m.state_dict())
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    before, clips = Snapshot(), _clip_functions()
    m, opt = amp_patch.initialize(m, opt, opt_level=level, half_dtype="bfloat16", cast_policy="parity", verbosity=0)
    try:
        now = _clip_functions()
        assert before.changed() == [] and all(now[k] is f for k, f in clips.items())
        x = torch.randn(2, 4)
        for model, o in ((m, opt), (ref.to(next(m.parameters()).dtype), ref_opt)):
            model(x.to(next(model.parameters()).dtype)).float().pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    finally:
        amp_patch.deinitialize()


def test_loading_a_loss_scale_into_an_o0_run_patches_what_scaling_needs():
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    clips, backward = _clip_functions(), torch.Tensor.backward
    amp_patch.initialize(m, opt, opt_level="O0", verbosity=0)
    try:
        assert torch.Tensor.backward is backward
        amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 128.0}})
        assert vars(torch.Tensor)["backward"] is not backward
        assert _clip_functions()[("torch.nn.utils", "clip_grad_norm_")] is not clips[("torch.nn.utils", "clip_grad_norm_")]
        seen = []
        m.weight.register_hook(lambda g: seen.append(g.clone()))
        x = torch.randn(2, 4)
        w0 = m.weight.detach().clone()
        m(x).sum().backward()  # a plain backward, now scaled by the loaded scale
        want = x.sum(0).expand(4, 4)
        assert torch.allclose(seen[0], 128.0 * want)
        opt.step()  # unscaled before the update
        assert torch.allclose(m.weight.detach(), w0 - 0.1 * want)
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("half", HALVES, ids=["fp16", "bf16"])
def test_o1_linear_runs_in_half_and_matches_hand_cast(o1, half):
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    expected = F.linear(x.to(half), lin.weight.to(half), lin.bias.to(half))
    o1(half)
    out = lin(x)
    assert out.dtype == half
    assert torch.equal(out, expected)


@pytest.mark.quick
def test_o4_is_bf16_and_default_on_cpu_is_bf16():
    amp_patch.initialize(None, None, "O4")
    try:
        assert F.linear(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    finally:
        amp_patch.deinitialize()
    amp_patch.initialize(nn.Linear(2, 2), None, "O1")
    try:
        assert F.linear(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    finally:
        amp_patch.deinitialize()


def test_tensor_methods_cast_their_receiver(o1):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    o1(torch.float16)
    for out in (a.mm(b), torch.Tensor.mm(a, b), a @ b, a.matmul(b)):
        assert out.dtype == torch.float16
    with amp_patch.disable_casts():
        expected = a.half().mm(b.half())
    assert torch.equal(a.mm(b), expected)


def test_float_policy_and_promote(o1):
    o1(torch.float16)
    h = torch.randn(4, dtype=torch.float16)
    f = torch.randn(4)
    assert F.softmax(h, -1).dtype == torch.float32
    assert (h + f).dtype == torch.float32
    assert torch.cat([h, f]).dtype == torch.float32
    assert torch.cat([h, h]).dtype == torch.float16
    # a 0-dim FP32 tensor promotes as torch promotes it: not at all (torch.mul agrees)
    s = torch.tensor(2.0)
    assert (h * s).dtype == torch.mul(h, s).dtype == torch.float16
    d = torch.randn(4, dtype=torch.float64)
    assert F.softmax(d, -1).dtype == torch.float64  # float64 is never touched
    i = torch.arange(4)
    assert (i + i).dtype == torch.int64


def test_o4_runs_bf16_fft_in_fp32_where_torch_alone_raises():
    # CPU FFT kernels have no BF16 support; the float policy makes BF16 code work.
    x = torch.randn(16).bfloat16()
    with pytest.raises(RuntimeError, match="Unsupported dtype BFloat16"):
        torch.fft.rfft(x)
    expected = torch.fft.rfft(x.float())
    # A complex input is not cast: irfft sees it as it is.
    z = torch.randn(9, dtype=torch.complex64)
    expected_z = torch.fft.irfft(z)
    amp_patch.initialize(None, None, "O4")
    try:
        out, out_z = torch.fft.rfft(x), torch.fft.irfft(z)
    finally:
        amp_patch.deinitialize()
    assert out.dtype == torch.complex64
    assert torch.equal(out, expected)
    assert out_z.dtype == torch.float32 and torch.equal(out_z, expected_z)


def test_casting_recurses_into_containers_only_floating(o1):
    o1(torch.bfloat16)
    seqs = [torch.randn(2, 3), torch.randn(2, 3, dtype=torch.bfloat16)]
    assert torch.stack(seqs).dtype == torch.float32
    idx = torch.tensor([0, 1])
    t = torch.zeros(3)
    out = torch.index_put(t, (idx,), torch.ones(2, dtype=torch.bfloat16))
    assert out.dtype == torch.float32


def test_inplace_promote_keeps_receiver_dtype(o1):
    o1(torch.float16)
    f = torch.zeros(3)
    h = torch.ones(3, dtype=torch.float16)
    f += h
    assert f.dtype == torch.float32 and torch.equal(f, torch.ones(3))
    h2 = torch.ones(3, dtype=torch.float16)
    h2.addcmul_(torch.ones(3), torch.full((3,), 2.0))
    assert h2.dtype == torch.float16 and torch.equal(h2, torch.full((3,), 3.0, dtype=torch.float16))


def test_inplace_float_op_on_half_tensor_raises(o1):
    o1(torch.float16, lists={"torch.Tensor": {"float": ["exp_"]}})
    with pytest.raises(amp_patch.CastError, match=r"torch.Tensor.exp_ runs in float32 .* torch.float16 tensor"):
        torch.ones(2, dtype=torch.float16).exp_()
    f = torch.zeros(2)
    f.exp_()
    assert torch.equal(f, torch.ones(2))


INPLACE_OF_FLOAT_OPS = [
    ("torch.Tensor.exp_", lambda h: h.exp_()),
    ("torch.exp_", lambda h: torch.exp_(h)),
    ("torch.Tensor.pow_", lambda h: h.pow_(2)),
    ("torch.Tensor.__ipow__", lambda h: h.__ipow__(2)),
    ("torch.Tensor.log_", lambda h: h.log_()),
    ("torch.Tensor.cumsum_", lambda h: h.cumsum_(0)),
]


@pytest.mark.parametrize("name,call", INPLACE_OF_FLOAT_OPS, ids=[n.replace("torch.", "") for n, _ in INPLACE_OF_FLOAT_OPS])
def test_default_lists_refuse_inplace_forms_of_float_ops_on_a_half_receiver(name, call, o1):
    """Under FP16, ``exp`` runs in FP32, so ``exp_`` on an FP16 tensor raises (apex.amp's rule)
    and leaves the tensor as it was; on an FP32 tensor it runs as the original does."""
    o1(torch.float16)
    h = torch.rand(4, dtype=torch.float16) + 0.5
    before = h.clone()
    with pytest.raises(amp_patch.CastError, match=re.escape(name) + " runs in float32 .* in-place on a torch.float16") as info:
        call(h)
    assert "disable_casts" in str(info.value) and "out-of-place" in str(info.value)
    assert torch.equal(h, before)
    f, ref = before.float(), before.float()
    with amp_patch.disable_casts():
        call(ref)
    assert call(f) is f and f.dtype == torch.float32 and torch.equal(f, ref)
    with amp_patch.disable_casts():  # the documented way out runs it in half
        assert call(h).dtype == torch.float16


def test_inplace_forms_of_float_ops_run_in_place_under_bf16(o1):
    """exp is not FP32 under BF16 (CPU autocast leaves it to the input), so neither is exp_."""
    o1(torch.bfloat16)
    h = torch.rand(4, dtype=torch.bfloat16)
    want = h.clone()
    with amp_patch.disable_casts():
        want.exp_()
    assert h.exp_() is h and torch.equal(h, want)
    assert torch.Tensor.exp_ is vars(torch._C.TensorBase)["exp_"]  # not patched at all


def test_inplace_forms_of_half_ops_cast_their_other_inputs_to_the_receiver(o1):
    o1(torch.float16)
    acc = torch.zeros(2, 3)
    a, b = torch.rand(2, 4, dtype=torch.float16), torch.rand(4, 3)
    assert acc.addmm_(a, b) is acc and acc.dtype == torch.float32
    assert torch.equal(acc, torch.zeros(2, 3).addmm_(a.float(), b))
    hacc = torch.zeros(2, 3, dtype=torch.float16)
    hacc.addmm_(a, b)
    assert hacc.dtype == torch.float16 and torch.equal(hacc, torch.zeros(2, 3, dtype=torch.float16).addmm_(a, b.half()))


def test_inplace_forms_follow_overrides_of_their_op(o1):
    """Moving exp to half takes exp_ along; an explicit entry or a removal of exp_ wins."""
    o1(torch.float16, lists={"torch.Tensor": {"half": ["exp"], "remove": ["log_"], "float": ["sqrt_"]}})
    h = torch.rand(3, dtype=torch.float16)
    assert h.exp_().dtype == torch.float16
    assert torch.Tensor.log_ is vars(torch._C.TensorBase)["log_"]
    with pytest.raises(amp_patch.CastError, match="sqrt_"):
        h.sqrt_()


def test_torch_internal_inplace_ops_on_half_tensors_run_as_under_autocast(o1):
    """torch's own code (nn.init's truncated normal) uses pow_/log_/erfinv_ on tensors of
    any dtype; those calls are not user code and run unchanged."""
    def init():
        w = torch.empty(64, dtype=torch.float16)
        # a narrow window takes its rejection sampler, which runs pow_ and log_ on w's dtype
        torch.nn.init.trunc_normal_(w, a=-0.3, b=0.3, generator=torch.Generator().manual_seed(0))
        return w

    want = init()
    o1(torch.float16)
    got = init()
    assert got.dtype == torch.float16 and torch.equal(got, want)


@pytest.mark.quick
def test_banned_op_raises_not_implemented_under_fp16_and_runs_fp32_under_bf16():
    p, t = torch.rand(4), torch.rand(4)
    amp_patch.initialize(None, None, "O1", half_dtype="float16")
    try:
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, t)
        with amp_patch.disable_casts():
            F.binary_cross_entropy(p, t)
    finally:
        amp_patch.deinitialize()
    expected = F.binary_cross_entropy(p, t)
    amp_patch.initialize(None, None, "O4")
    try:
        out = F.binary_cross_entropy(p.bfloat16(), t.bfloat16())
        assert out.dtype == torch.float32
        assert torch.equal(out, F.binary_cross_entropy(p.bfloat16().float(), t.bfloat16().float()))
    finally:
        amp_patch.deinitialize()
    assert expected.dtype == torch.float32


def test_disable_casts_nests_and_is_exception_safe(o1):
    o1(torch.float16)
    x = torch.randn(2, 2)
    with amp_patch.disable_casts():
        with amp_patch.disable_casts():
            assert (x @ x).dtype == torch.float32
        assert (x @ x).dtype == torch.float32
        with pytest.raises(ZeroDivisionError):
            with amp_patch.disable_casts():
                1 / 0
        assert (x @ x).dtype == torch.float32
    assert (x @ x).dtype == torch.float16


def test_disable_casts_is_per_thread(o1):
    o1(torch.float16)
    x = torch.randn(2, 2)
    inside, other = threading.Event(), []

    def worker():
        inside.wait(5)
        other.append((x @ x).dtype)

    t = threading.Thread(target=worker)
    t.start()
    with amp_patch.disable_casts():
        inside.set()
        t.join(5)
        assert (x @ x).dtype == torch.float32
    assert other == [torch.float16]


@pytest.mark.quick
def test_weight_cast_cache_hits_and_invalidates_on_inplace_edit():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    amp_patch.initialize(lin, None, "O1", half_dtype="bfloat16")
    try:
        from amp_patch.base import running

        cache = running.session().cache
        lin(x)
        F.linear(x, lin.weight, lin.bias)  # until the next forward starts, the copies serve
        assert cache.hits >= 2 and len(cache) == 2  # weight and bias cast once
        with torch.no_grad():
            lin.weight.mul_(2)  # in-place edit between two forwards
        out = lin(x)
        expected = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
        with amp_patch.disable_casts():
            assert torch.equal(out, expected)
        lin.load_state_dict({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)})
        assert torch.equal(lin(x), torch.zeros(2, 4, dtype=torch.bfloat16))
    finally:
        amp_patch.deinitialize()


def test_cache_is_emptied_after_backward_and_does_not_grow():
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    amp_patch.initialize(lin, opt, "O1", half_dtype="bfloat16")
    try:
        from amp_patch.base import running

        cache = running.session().cache
        for _ in range(50):
            opt.zero_grad()
            lin(torch.randn(2, 4)).float().sum().backward()
            assert len(cache) == 0
            opt.step()
        assert lin.weight.grad.dtype == torch.float32
    finally:
        amp_patch.deinitialize()


def test_half_weight_copies_are_freed_as_the_backward_releases_them():
    """The cache lets go of its copies when the backward starts, so a copy that
    autograd did not save (the first layer's, whose input needs no gradient) is
    gone before the backward runs, as under autocast."""
    import weakref

    lin = nn.Linear(4, 4)
    amp_patch.initialize(lin, None, "O1", half_dtype="bfloat16")
    try:
        from amp_patch.base import running

        cache = running.session().cache
        out = lin(torch.randn(2, 4))
        copies = [weakref.ref(entry[4]) for entry in cache._maps[1].values()]
        assert len(copies) == 2  # weight and bias
        seen = []
        out.register_hook(lambda g: seen.append((len(cache), [c() is None for c in copies])))
        out.float().sum().backward()
        assert seen == [(0, [True, True])]
        assert lin.weight.grad.dtype == torch.float32
    finally:
        amp_patch.deinitialize()


def test_cached_cast_from_no_grad_is_not_reused_with_grad():
    lin = nn.Linear(4, 4)
    amp_patch.initialize(lin, None, "O1", half_dtype="bfloat16")
    try:
        with torch.no_grad():
            lin(torch.randn(2, 4))
        out = lin(torch.randn(2, 4))
        out.float().sum().backward()
        assert lin.weight.grad is not None
    finally:
        amp_patch.deinitialize()


def test_second_initialize_adds_models_without_stacking_wrappers():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    amp_patch.initialize(a, None, "O1", half_dtype="float16")
    try:
        linear_once = F.linear
        amp_patch.initialize(b, None, "O1", half_dtype="float16")
        assert F.linear is linear_once
        from amp_patch.base import running

        assert running.session().models == [a, b]
        with pytest.raises(ConfigError, match="already initialized with opt_level='O1'.*deinitialize"):
            amp_patch.initialize(nn.Linear(2, 2), None, "O4")
        with pytest.raises(ConfigError, match="already initialized"):
            amp_patch.initialize(a, None, "O1", half_dtype="float16")
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(opt_level="O8"), ConfigError, "opt_level='O8' is not an opt level; use one of O0, O1, O2, O3, O4, O5, O6, O7"),
        (dict(opt_level="01"), ConfigError, "the letter O, not zero"),
        (dict(opt_level="O1", keep_batchnorm=True), ConfigError, "did you mean 'keep_batchnorm_fp32'"),
        (dict(opt_level="O1", half_dtype=torch.float64), ConfigError, "half_dtype=torch.float64 is not supported"),
        (dict(opt_level="O1", loss_scale=-1), ConfigError, "loss_scale=-1 is not a loss scale; use 'dynamic' or a positive"),
        (dict(opt_level="O1", loss_scale="big"), ConfigError, "loss_scale='big'"),
        (dict(opt_level="O1", master_weights=True), ConfigError, "these models are all FP32, so FP32 master weights would copy them for nothing"),
        (dict(opt_level="O2", cast_model_type=torch.float32), ConfigError, "master_weights=True with cast_model_type=torch.float32 makes no sense"),
        (dict(opt_level="O1", keep_batchnorm_fp32="yes"), ConfigError, "keep_batchnorm_fp32='yes' must be True, False"),
    ],
)
def test_bad_configuration_raises_and_patches_nothing(kwargs, error, fragment):
    before = Snapshot()
    with pytest.raises(error) as info:
        amp_patch.initialize(nn.Linear(2, 2), None, **kwargs)
    assert fragment in str(info.value)
    assert before.changed() == [] and not amp_patch.is_initialized()


def test_wrong_types_name_the_argument():
    with pytest.raises(ConfigError, match="models is a builtins.str; initialize expects torch.nn.Module"):
        amp_patch.initialize("model", None, "O1")
    with pytest.raises(ConfigError, match=r"optimizers\[1\] is a builtins.int"):
        amp_patch.initialize(nn.Linear(2, 2), [torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1), 3], "O1")


def test_meta_model_is_refused():
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="meta device.*to_empty"):
        amp_patch.initialize(m, None, "O1")


@pytest.mark.quick
def test_failure_half_way_through_patching_undoes_everything(monkeypatch):
    from amp_patch.run import plan

    before = Snapshot()
    real = plan.patch_items

    def items_then_boom(amp, registrations):
        items = real(amp, registrations)

        def boom(original):
            raise RuntimeError("boom")

        return items[:50] + [(torch, "relu", boom)] + items[50:]

    monkeypatch.setattr(plan, "patch_items", items_then_boom)
    with pytest.raises(RuntimeError, match="boom"):
        amp_patch.initialize(None, None, "O1")
    monkeypatch.undo()
    assert before.changed() == [] and not amp_patch.is_initialized()


@pytest.mark.quick
def test_register_functions_and_decorators():
    import types

    mod = types.SimpleNamespace()

    def my_matmul(a, b):
        return a @ b

    mod.my_matmul = my_matmul
    mod.my_float = lambda a: a * 1
    amp_patch.register_half_function(mod, "my_matmul")
    amp_patch.register_float_function(mod, "my_float")

    @amp_patch.promote_function
    def add(a, b):
        return a + b

    @amp_patch.float_function
    def softish(x):
        return x.exp()

    from amp_patch import frontend

    try:
        a = torch.randn(2, 2)
        assert mod.my_matmul(a, a).dtype == torch.float32  # inactive: straight through
        amp_patch.initialize(None, None, "O1", half_dtype="float16")
        try:
            assert mod.my_matmul(a, a).dtype == torch.float16
            assert mod.my_float(a.half()).dtype == torch.float32
            assert add(a.half(), a).dtype == torch.float32
            assert softish(a.half()).dtype == torch.float32
        finally:
            amp_patch.deinitialize()
        assert mod.my_matmul is my_matmul
        with pytest.raises(ConfigError, match="has no attribute 'nope'"):
            amp_patch.register_half_function(mod, "nope")
    finally:
        frontend._user_registrations.clear()


def test_registered_method_of_a_class_keeps_its_receiver():
    """A registered instance method is called with its own ``self`` and its
    tensor arguments cast, whether reached through an instance or the class."""

    class Scaler:
        def __init__(self, k):
            self.k = k

        def apply(self, x, w):
            return (x @ w) * self.k

    from amp_patch import frontend

    amp_patch.register_half_function(Scaler, "apply")
    try:
        s = Scaler(3.0)
        x, w = torch.randn(2, 4), torch.randn(4, 4)
        amp_patch.initialize(None, None, "O1", half_dtype=torch.float16)
        try:
            for out in (s.apply(x, w), Scaler.apply(s, x, w), s.apply(x, w=w)):
                assert out.dtype == torch.float16
                assert torch.equal(out, (x.half() @ w.half()) * 3.0)
        finally:
            amp_patch.deinitialize()
        assert vars(Scaler)["apply"].__name__ == "apply" and not hasattr(vars(Scaler)["apply"], "__wrapped__")
    finally:
        frontend._user_registrations.clear()


def test_patched_python_function_binds_like_the_original_as_a_class_attribute(o1):
    """A module-level Python function stored on a class after initialize binds
    to the instance as the plain function would, and still casts."""
    original = F.mse_loss
    o1(torch.bfloat16)
    assert isinstance(F.mse_loss, wrapt.FunctionWrapper) and F.mse_loss.__wrapped__ is original

    class Loss:
        fn = F.mse_loss

    class Plain:
        fn = original

    x, y = torch.randn(4, 4).bfloat16(), torch.randn(4, 4).bfloat16()
    # bound: the instance becomes the first argument, with or without amp_patch
    with pytest.raises(Exception) as plain:
        Plain().fn(x, y)
    with pytest.raises(type(plain.value), match=str(plain.value).replace("Plain", "Loss")):
        Loss().fn(x, y)
    out = Loss.fn(x, y)  # through the class: a plain call
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.mse_loss.__wrapped__(x.float(), y.float()))


def test_tensor_method_wrapper_binds_its_receiver(o1):
    o1(torch.bfloat16)
    x, y = torch.randn(3, 3), torch.randn(3, 3).bfloat16()
    bound = x.__add__
    assert bound.__self__ is x and isinstance(torch.Tensor.__add__, wrapt.FunctionWrapper)
    assert torch.Tensor.__add__.__wrapped__ is torch._C.TensorBase.__add__
    for out in (bound(y), torch.Tensor.__add__(x, y), x + y, y + x):
        assert out.dtype == torch.float32  # promote: FP32 with BF16 runs in FP32
        assert torch.equal(out, torch._C.TensorBase.__add__(x, y.float()))
    with pytest.raises(TypeError):
        torch.Tensor.__add__()  # no receiver: torch's own error


def test_returns_structure_it_was_given():
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    o = torch.optim.SGD(m1.parameters(), 0.1)
    try:
        out = amp_patch.initialize([m1, m2], o, "O1")
        assert isinstance(out, tuple) and out[0] == [m1, m2] and out[1] is o
    finally:
        amp_patch.deinitialize()
    try:
        assert amp_patch.initialize(m1, opt_level="O1") is m1
    finally:
        amp_patch.deinitialize()


def test_deinitialize_after_exception_in_training_step_restores_torch():
    before = Snapshot()
    m = nn.Linear(2, 2)
    amp_patch.initialize(m, None, "O1")
    try:
        with pytest.raises(RuntimeError):
            m(torch.randn(3, 5))  # wrong shape inside a patched op
    finally:
        amp_patch.deinitialize()
    assert before.changed() == []
