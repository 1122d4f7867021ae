"""A zero-code run changes nothing a script computes but precision.

Each test is written the way the scripts that hit the problem are written: a
GAN whose second optimizer amp_patch never saw, FGSM on an input, a
FixMatch-style EMA copy, numpy-based evaluation, a Hugging Face save and
reload; through ``initialize`` and through the launcher. docs/guide.md's "What a run
under amp_patch computes" table points at these tests.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.frontends import launcher
from amp_patch.frontends.launcher import Settings
from helpers import amp, mlp, write

FP16 = dict(half_dtype=torch.float16)


def _net(seed, *sizes):
    return mlp(*sizes, seed=seed, act=nn.Tanh)


def _quiet():
    return warnings.catch_warnings()


@contextlib.contextmanager
def _deinit():
    try:
        yield
    finally:
        amp_patch.deinitialize()


# ------------------------------------------------------------ scaled gradients


def test_a_second_network_amp_patch_never_saw_gets_true_gradients():
    """GAN: only G's optimizer is given to initialize; G's loss backward reaches
    D, whose optimizer steps on what it finds in D's .grad."""
    G, D = _net(0, 4, 8, 4), _net(1, 4, 8, 1)
    optG = torch.optim.SGD(G.parameters(), lr=0.1)
    optD = torch.optim.SGD(D.parameters(), lr=0.1)
    z = torch.randn(16, 4)
    with _quiet():
        warnings.simplefilter("ignore")  # FP16 on a CPU
        amp_patch.initialize(G, optG, "O1", verbosity=1, loss_scale=1024.0, **FP16)
    with _deinit():
        loss = D(G(z)).float().mean()
        expected = torch.autograd.grad(loss, list(D.parameters()), retain_graph=True)  # unscaled
        with pytest.warns(amp_patch.AmpWarning, match=r"reached 4 parameter\(s\) that no optimizer given to amp_patch owns"):
            loss.backward()
        for p, g in zip(D.parameters(), expected):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
        before = [p.detach().clone() for p in D.parameters()]
        optD.step()
        moved = max((p - b).abs().max().item() for p, b in zip(D.parameters(), before))
        assert moved < 1.0  # a 65536x gradient moved it by thousands


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_backward_with_no_optimizer_attached_says_nothing_scaled_it(half):
    """``initialize(model)`` alone, then an optimizer built after it (a trainer
    that builds its own): under FP16 nothing can scale the loss or skip a step,
    and the first backward says so, once, naming the fixes. BF16 needs no
    scaling and says nothing; the gradients are the plain ones either way."""
    model = _net(0, 4, 8, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with _quiet():
        warnings.simplefilter("ignore")  # FP16 on a CPU
        amp_patch.initialize(model, opt_level="O1", verbosity=1, half_dtype=getattr(torch, half))
    with _deinit():
        loss = F.cross_entropy(model(x).float(), y)
        expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss.backward(retain_graph=True)
            model.zero_grad()
            loss.backward()  # once per run
        said = [str(w.message) for w in seen if issubclass(w.category, amp_patch.AmpWarning)]
        if half == "float16":
            assert len(said) == 1, said
            assert "no optimizer is attached to amp_patch, so the loss was not scaled" in said[0]
            assert "amp_patch.adopt_optimizer(optimizer)" in said[0] and "optimizers=(optimizer, None)" in said[0]
        else:
            assert said == []
        for p, g in zip(model.parameters(), expected):
            assert torch.equal(p.grad, g)


def test_a_grad_scaler_kept_beside_initialize_is_named_once():
    """``initialize`` added to a native-AMP loop that kept its GradScaler: the loss
    is scaled twice. The script's first ``scaler.scale()`` says so, once, with
    the fix; a disabled scaler, or BF16 (nothing scaled), says nothing; and the
    patch goes with ``deinitialize``."""
    original = torch.amp.GradScaler.scale
    for half, enabled, want in (("float16", True, 1), ("float16", False, 0), ("bfloat16", True, 0)):
        model = _net(0, 4, 8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=enabled)
        x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
        with _quiet():
            warnings.simplefilter("ignore")  # FP16 on a CPU
            amp_patch.initialize(model, opt, "O1", verbosity=1, half_dtype=getattr(torch, half))
        with _deinit(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.zero_grad()
                scaler.scale(F.cross_entropy(model(x).float(), y)).backward()
        said = [str(w.message) for w in seen if "GradScaler.scale() under amp_patch's loss scaling" in str(w.message)]
        assert len(said) == want, (half, enabled, said)
        if want:
            assert "this loss is scaled twice" in said[0] and "enabled=False" in said[0]
        assert torch.amp.GradScaler.scale is original


def test_an_overflow_in_a_foreign_gradient_skips_the_step_and_is_zeroed():
    """D's last bias gathers the whole scaled loss (65536 > FP16's 65504): the
    attached optimizer skips and backs off, and D's optimizer, which amp_patch
    cannot skip, finds zeros there instead of inf."""
    G, D = _net(0, 4, 8, 4), _net(1, 4, 8, 1)
    optG = torch.optim.SGD(G.parameters(), lr=0.1)
    z = torch.randn(16, 4)
    with amp(G, optG, "O1", **FP16), _quiet():
        warnings.simplefilter("ignore")
        loss = D(G(z)).float().mean()
        expected = torch.autograd.grad(loss, list(D.parameters()), retain_graph=True)
        loss.backward()
        assert torch.equal(D[2].bias.grad, torch.zeros(1))
        torch.testing.assert_close(D[0].weight.grad, expected[0], rtol=0, atol=0)
        before = [p.detach().clone() for p in G.parameters()]
        optG.step()
        assert all(torch.equal(p, b) for p, b in zip(G.parameters(), before))  # skipped
        c = amp_patch.counters()
        assert c["optimizers"][0]["skipped"] == 1 and c["loss_scale"] == [32768.0]


def test_fgsm_input_gradient_is_the_true_gradient():
    model = _net(0, 4, 8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4, requires_grad=True)
    y = torch.tensor([0, 1, 2, 0, 1])
    with amp(model, opt, "O1", **FP16):
        loss = F.cross_entropy(model(x).float(), y)
        expected, = torch.autograd.grad(loss, x, retain_graph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an input is no parameter: nothing to say
            loss.backward()
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
        x_adv = x + 0.1 * x.grad.sign()
        assert x_adv.sub(x).abs().max().item() == pytest.approx(0.1)
        # the model's own gradients are still unscaled at its step, as before
        amp_patch.unscale_(opt)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_foreign_gradients_accumulate_unscaled_over_two_backwards():
    D = _net(1, 4, 1)
    G = _net(0, 4, 4)
    optG = torch.optim.SGD(G.parameters(), lr=0.1)
    z = torch.randn(8, 4)
    with amp(G, optG, "O1", loss_scale=1024.0, **FP16), _quiet():
        warnings.simplefilter("ignore")
        total = [torch.zeros_like(p) for p in D.parameters()]
        for _ in range(2):
            loss = D(G(z)).float().mean()
            for t, g in zip(total, torch.autograd.grad(loss, list(D.parameters()), retain_graph=True)):
                t += g
            loss.backward()
        for p, t in zip(D.parameters(), total):
            torch.testing.assert_close(p.grad, t)


def test_a_backward_that_reaches_no_owned_parameter_is_not_scaled():
    """A teacher or critic alone: nothing of amp_patch's to unscale, so no scale."""
    model = _net(0, 4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = _net(1, 4, 1)
    with amp(model, opt, "O1", **FP16), _quiet():
        warnings.simplefilter("ignore")
        loss = other(torch.randn(3, 4)).float().sum()
        expected = torch.autograd.grad(loss, list(other.parameters()), retain_graph=True)
        loss.backward()
        for p, g in zip(other.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
        assert amp_patch.counters()["optimizers"][0]["steps"] == 0


def test_scale_loss_leaves_foreign_leaves_unscaled_too():
    model = _net(0, 4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)
    with amp(model, opt, "O1", **FP16):
        loss = model(x).float().pow(2).mean()
        expected, = torch.autograd.grad(loss, x, retain_graph=True)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@pytest.mark.quick
def test_bf16_backward_touches_no_gradient():
    """BF16 has no loss scale: the walk never runs, gradients are autograd's."""
    model = _net(0, 4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)
    with amp(model, opt, "O4"):
        loss = model(x).float().sum()
        expected, = torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward()
        assert torch.equal(x.grad, expected)


GAN = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optG = torch.optim.SGD(G.parameters(), lr=0.05)
    # the second optimizer is built where the launcher cannot tell its model
    # apart (it adopts it: O1 needs no model), so both are attached here
    optD = torch.optim.SGD(D.parameters(), lr=0.05)
    z = torch.randn(16, 4)
    moves = []
    for _ in range(3):
        optD.zero_grad(); optG.zero_grad()
        before = D[0].weight.detach().clone()
        lossG = -D(G(z)).float().mean()
        lossG.backward()
        optG.step()
        lossD = D(G(z).detach()).float().mean()
        lossD.backward()
        optD.step()
        moves.append((D[0].weight - before).abs().max().item())
"""


def test_a_gan_under_the_launcher_moves_its_weights_by_true_gradients(tmp_path):
    script = write(tmp_path, "gan.py", GAN)
    with _quiet():
        warnings.simplefilter("ignore")
        out = launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="float16"))
    assert max(out["moves"]) < 0.5, out["moves"]


# ------------------------------------------------------------ copies of an O2 model


def _o2(level="O2", **kw):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


class ModelEMA:
    """FixMatch's EMA, as its repositories write it."""

    def __init__(self, model, decay):
        self.ema = copy.deepcopy(model)
        self.ema.eval()
        self.decay = decay
        self.param_keys = [k for k, _ in self.ema.named_parameters()]
        self.buffer_keys = [k for k, _ in self.ema.named_buffers()]
        for p in self.ema.parameters():
            p.requires_grad_(False)

    def update(self, model):
        with torch.no_grad():
            msd = model.state_dict()
            esd = self.ema.state_dict()
            for k in self.param_keys:
                esd[k].copy_(esd[k] * self.decay + (1.0 - self.decay) * msd[k].detach())
            for k in self.buffer_keys:
                esd[k].copy_(msd[k])


def _train(model, opt, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_fixmatch_ema_of_an_o2_model_follows_the_fp32_weights(level):
    model, opt = _o2()
    with amp(model, opt, level):
        ema = ModelEMA(model, 0.9)
        start = {k: v.clone() for k, v in ema.ema.state_dict().items()}
        for _ in range(3):
            _train(model, opt, steps=1)
            ema.update(model)
            # the copy is plain FP32: its state_dict values are its parameters
            for k, p in ema.ema.named_parameters():
                assert p.dtype == torch.float32
                assert ema.ema.state_dict()[k].data_ptr() == p.data_ptr()
        masters = {k: v for k, v in model.state_dict().items()}
        for k in ema.param_keys:
            assert not torch.equal(ema.ema.state_dict()[k], start[k]), k
        # one more update from the FP32 masters, by hand, is what the copy holds
        expected = {k: ema.ema.state_dict()[k] * 0.9 + 0.1 * masters[k] for k in ema.param_keys}
        ema.update(model)
        for k in ema.param_keys:
            torch.testing.assert_close(ema.ema.state_dict()[k], expected[k], rtol=0, atol=0)


@pytest.mark.quick
def test_a_deep_copy_is_a_plain_fp32_model_with_the_masters_values():
    model, opt = _o2()
    with amp(model, opt, "O2"):
        _train(model, opt)
        copied = copy.deepcopy(model)
        assert all(p.dtype == torch.float32 for p in copied.parameters())
        assert all(not m._forward_pre_hooks and not m._forward_hooks and not m._state_dict_hooks
                   and not m._load_state_dict_pre_hooks for m in copied.modules())
        assert "__deepcopy__" not in vars(copied) and "__reduce_ex__" not in vars(copied)
        for (k, a), b in zip(copied.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), k  # the masters' exact values
        x = torch.randn(5, 4)
        copied.eval()
        assert copied(x).dtype == torch.float32
        # a submodule copies the same way
        assert copy.deepcopy(model[0]).weight.dtype == torch.float32
    assert "__deepcopy__" not in vars(model)  # deinitialize took the copy rule away


def test_copy_load_state_dict_and_named_parameters_work_as_in_torch():
    model, opt = _o2()
    with amp(model, opt, "O2"):
        copied = copy.deepcopy(model)
        fresh = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in copied.state_dict().items()}
        missing = copied.load_state_dict({k: v for k, v in fresh.items() if k != "3.bias"}, strict=False)
        assert missing.missing_keys == ["3.bias"]
        assert torch.equal(copied[0].weight, torch.full((8, 4), 0.5))
        for name, p in copied.named_parameters():
            p.data.mul_(2)
            assert torch.equal(copied.state_dict()[name], p)


def test_averaged_model_of_an_o2_model_averages_in_fp32():
    model, opt = _o2()
    with amp(model, opt, "O2"):
        swa = torch.optim.swa_utils.AveragedModel(model)
        for _ in range(2):
            _train(model, opt, steps=1)
            swa.update_parameters(model)
        assert all(p.dtype == torch.float32 for p in swa.module.parameters())
        assert int(swa.n_averaged) == 2
        swa.eval()
        assert swa(torch.randn(2, 4)).dtype == torch.float32


def test_torch_save_of_the_whole_module_saves_the_plain_fp32_model():
    model, opt = _o2()
    with amp(model, opt, "O2"):
        _train(model, opt)
        buf = io.BytesIO()
        torch.save(model, buf)
        expected = model.state_dict()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is nn.Sequential
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks
    for (k, a), b in zip(loaded.state_dict().items(), expected.values()):
        assert torch.equal(a, b), k


def test_writes_into_the_originals_state_dict_reach_the_model():
    """`own = model.state_dict(); own[k].copy_(pretrained[k])`, the classic partial load."""
    model, opt = _o2()
    new = torch.randn(8, 4)
    with amp(model, opt, "O2"):
        own = model.state_dict()
        own["0.weight"].copy_(new)
        model.train()
        model(torch.randn(8, 4))  # the forward sees the written weights
        assert torch.equal(model[0].weight, new.to(torch.bfloat16))
        assert torch.equal(next(amp_patch.master_params(opt)), new)
    assert torch.equal(model[0].weight, new)  # deinitialize keeps it, exactly


def test_a_launched_fixmatch_script_updates_its_ema(tmp_path):
    script = write(tmp_path, "fixmatch.py", """
        import copy, torch, torch.nn as nn, torch.nn.functional as F
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # the launcher converts the model here
        ema = copy.deepcopy(model)
        start = {k: v.clone() for k, v in ema.state_dict().items()}
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            optimizer.step()
            with torch.no_grad():
                msd, esd = model.state_dict(), ema.state_dict()
                for k in esd:
                    esd[k].copy_(esd[k] * 0.5 + 0.5 * msd[k])
        changed = [k for k in start if not torch.equal(start[k], ema.state_dict()[k])]
        dtypes = {p.dtype for p in ema.parameters()}
    """)
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O5"))
    assert sorted(out["changed"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert out["dtypes"] == {torch.float32}


# ------------------------------------------------------------ dtypes handed to user code


NUMPY_EVAL = """
    import torch, torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    with torch.no_grad():
        logits = model(torch.randn(5, 4))
    preds = logits.detach().cpu().numpy().argmax(1)
    dtype = logits.dtype
"""


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_numpy_evaluation_works_under_the_launcher(tmp_path, level):
    script = write(tmp_path, "evaluate.py", NUMPY_EVAL)
    out = launcher.run(str(script), [], Settings.resolve(opt_level=level))
    assert out["dtype"] == torch.float32
    assert out["preds"].shape == (5,)


def test_half_outputs_are_an_option(tmp_path, monkeypatch):
    script = write(tmp_path, "evaluate.py", NUMPY_EVAL.replace("preds = logits.detach().cpu().numpy().argmax(1)", ""))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1", outputs="half"))
    assert out["dtype"] == torch.bfloat16
    monkeypatch.setenv("AMP_PATCH_OUTPUTS", "half")
    assert Settings.resolve().outputs == "half"
    monkeypatch.setenv("AMP_PATCH_OUTPUTS", "fp8")
    with pytest.raises(amp_patch.ConfigError, match="AMP_PATCH_OUTPUTS='fp8' is not an output choice; use float32"):
        Settings.resolve()


def test_the_apex_api_returns_fp32_outputs_at_o1_by_default():
    from amp_patch import amp as apex_amp

    model = _net(0, 4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = apex_amp.initialize(model, opt, opt_level="O1", verbosity=0)
    try:
        assert model(torch.randn(2, 4)).dtype == torch.float32
    finally:
        amp_patch.deinitialize()
    model, opt = apex_amp.initialize(model, opt, opt_level="O1", cast_model_outputs=torch.bfloat16, verbosity=0)
    try:
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    finally:
        amp_patch.deinitialize()
    assert not model._forward_hooks


def test_hugging_face_save_pretrained_of_an_o2_model_reloads_in_fp32(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with amp(model, opt, "O5"):
        ids = torch.randint(0, 64, (2, 8))
        model(ids, labels=ids).loss.backward()
        opt.step()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.dtype == torch.float32
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert "save_pretrained" not in vars(model)


# ------------------------------------------------------------ messages under the launcher


def test_launcher_warnings_point_at_the_scripts_line(tmp_path, monkeypatch):
    from amp_patch import diagnostics

    monkeypatch.setattr(diagnostics.notices, "_warned", set())
    script = write(tmp_path, "train.py", """
        import torch
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(3, 4)).float().sum()
    """)
    with pytest.warns(amp_patch.AmpWarning, match="O1 runs in float16 on the CPU") as rec:
        launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="float16"))
    w = [w for w in rec if "runs in float16" in str(w.message)]
    assert len(w) == 1 and w[0].filename == str(script) and w[0].lineno == 5


def test_a_level_the_script_replaces_gives_no_warning(tmp_path, monkeypatch):
    from amp_patch import diagnostics

    monkeypatch.setattr(diagnostics.notices, "_warned", set())
    script = write(tmp_path, "train.py", """
        import torch
        from apex import amp
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        loss = model(torch.randn(3, 4)).float().sum()
    """)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="float16"))
    texts = [(str(w.message), w.filename, w.lineno) for w in rec if isinstance(w.message, amp_patch.AmpWarning)]
    assert not [t for t in texts if "O1 runs" in t[0]], texts
    o2 = [t for t in texts if "O2 runs in float16" in t[0]]
    assert len(o2) == 1 and o2[0][1:] == (str(script), 6)


# ------------------------------------------------------------ frozen parameters, failed conversions


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_frozen_parameters_keep_their_exact_fp32_values(level):
    """The usual frozen-backbone fine-tune: the optimizer holds the head only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("0.")}
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with amp(model, opt, level, **({"half_dtype": torch.float16} if level == "O2" else {})):
        assert model[0].weight.dtype in (torch.float16, torch.bfloat16)
        _train(model, opt)
        sd = model.state_dict()
        for k, v in frozen.items():
            assert torch.equal(sd[k], v), k  # not the half-rounded values
        twin = copy.deepcopy(model)
        assert torch.equal(twin[0].weight, frozen["0.weight"])
    for k, v in frozen.items():
        assert torch.equal(model.state_dict()[k], v), k  # deinitialize gives them back exactly


def test_a_scripted_module_is_refused_at_o2_and_nothing_changes():
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Linear(4, 2)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(amp_patch.ConfigError, match=r"its submodule '1' is a torch.jit.script-ed module.*Initialize the plain"):
        amp_patch.initialize(model, opt, "O2")
    assert not amp_patch.is_initialized()
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k])


def test_a_scripted_module_at_o1_is_named_as_running_in_fp32():
    model = torch.jit.script(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(amp_patch.AmpWarning, match=r"model 0 \(RecursiveScriptModule\): it is torch.jit.script-ed.*runs wholly in FP32"):
        amp_patch.initialize(model, opt, "O1")
    amp_patch.deinitialize()


@pytest.mark.parametrize("later", [False, True])
def test_a_conversion_that_fails_half_way_is_undone(monkeypatch, later):
    """Every step of conversion is undone on a failure, for a first and a later initialize."""
    from amp_patch.precision import model as model_side

    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if later:
        amp_patch.initialize(first, torch.optim.SGD(first.parameters(), lr=0.1), "O2", verbosity=0)
    calls = []
    real = model_side._checkpoint_hooks

    def fail_on_second(mod, save_dtype, rec):
        calls.append(mod)
        if len(calls) == 2:
            raise RuntimeError("boom from torch")
        return real(mod, save_dtype, rec)

    monkeypatch.setattr(model_side, "_checkpoint_hooks", fail_on_second)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            amp_patch.initialize(model, opt, "O2", verbosity=0)
        assert len(calls) == 2
        for k, v in model.state_dict().items():
            assert v.dtype == torch.float32 and torch.equal(v, before[k]), k
        assert all(not m._forward_pre_hooks and not m._state_dict_hooks for m in model.modules())
        assert "__deepcopy__" not in vars(model)
    finally:
        amp_patch.deinitialize() if amp_patch.is_initialized() else None


def test_a_half_buffer_the_model_updates_is_saved_as_it_is_now():
    """At O3 batchnorm is half too: its running statistics change in the
    forward (kernels do not bump version counters), and state_dict() gives the
    current values, not the ones from before the cast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O3"):
        model(torch.randn(16, 4) * 3 + 1)
        sd = model.state_dict()
        assert sd["1.running_mean"].dtype == torch.float32
        assert torch.equal(sd["1.running_mean"], model[1].running_mean.float())
        assert sd["1.running_mean"].abs().sum() > 0


# ---------------------------------------------------------------- the script changes the model's dtype itself


@pytest.mark.parametrize("change", ["half", "float", "to-float32", "to-float16"])
def test_a_dtype_change_of_a_converted_model_is_refused_at_its_next_forward(change):
    model = mlp(4, 8, 2, norm="batch")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        {"half": model.half, "float": model.float, "to-float32": lambda: model.to(torch.float32),
         "to-float16": lambda: model.to(torch.float16)}[change]()
        with pytest.raises(amp_patch.StateError, match=r"Sequential's parameters are torch\.float(16|32) now, but amp_patch "
                           r"converted the model to torch\.bfloat16 at opt_level='O2'.*use a copy \(copy\.deepcopy\(model\)"):
            model(torch.randn(5, 4))


def test_moving_a_converted_model_to_its_own_dtype_or_device_changes_nothing():
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        x = torch.randn(5, 4)
        before = model(x)
        model.to(torch.bfloat16).to("cpu")
        assert torch.equal(model(x), before) and before.dtype == torch.float32


# ---------------------------------------------------------------- evaluation and hooks


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_evaluation_under_no_grad_runs_as_training_does_and_records_no_graph(level):
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, level, half_dtype=torch.bfloat16, cast_model_outputs=torch.float32):
        x = torch.randn(5, 4)
        train_out = model(x)
        model.eval()
        with torch.no_grad():
            eval_out = model(x)
        with torch.inference_mode():
            inf_out = model(x)
        assert eval_out.dtype == inf_out.dtype == train_out.dtype == torch.float32
        assert not eval_out.requires_grad and eval_out.grad_fn is None
        assert torch.equal(eval_out, train_out.detach()) and torch.equal(inf_out, eval_out)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_forward_hook_sees_what_the_layer_computed(level):
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    with amp(model, opt, level, half_dtype=torch.bfloat16):
        model(torch.randn(5, 4))
        # O1 casts at the op (the input the hook sees is FP32, the output half);
        # O2 casts the model's input, so the layer sees half in and out
        assert seen == [(torch.float32 if level == "O1" else torch.bfloat16, torch.bfloat16)]
    seen.clear()
    model(torch.randn(5, 4))
    assert seen == [(torch.float32, torch.float32)]


def test_a_write_into_a_frozen_parameters_state_dict_value_reaches_the_half_model_and_survives_the_end():
    # A frozen backbone under O2: no optimizer owns it, so no master; its
    # state_dict() value is a view of the exact pre-cast value, as in plain torch.
    model = mlp(4, 8, 2)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        sd = model.state_dict()
        new = torch.linspace(-1, 1, sd["0.weight"].numel()).reshape(sd["0.weight"].shape)
        sd["0.weight"].copy_(new)
        assert torch.equal(model.state_dict()["0.weight"], new)  # saved as written, before any forward
        x = torch.randn(3, 4)
        out = model(x)
        assert torch.equal(model[0].weight, new.to(torch.bfloat16))  # the half model computes with it
        expected = F.linear(F.relu(F.linear(x.bfloat16(), new.bfloat16(), model[0].bias)), model[2].weight, model[2].bias)
        assert torch.equal(out, expected.float())
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, new)
