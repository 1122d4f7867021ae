"""Bad input and misuse: each a clear exception (type and message checked),
torch left exactly as it was, and the model untouched.

The tables below are the contract, one row per thing tried: ``ROWS`` (calls of
``initialize``), ``ORDER_ROWS`` (calls in the wrong order), ``LIST_ROWS`` (op
lists, as a file, a dict or ``$AMP_PATCH_LISTS``); each row names what was
tried and the message that comes back.

Plus numerical faults (NaN inputs, NaN every step, an inf written into a
weight by hand) and exceptions thrown from inside a training step.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from helpers import mlp, sgd, Snapshot
from amp_patch import ConfigError, ListError, OverflowLoopError, StateError

# FP16 on the CPU is deliberate here; amp_patch's advice to use BF16 there is
# not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")

f16, bf16 = torch.float16, torch.bfloat16


def _net():
    return mlp(4, 8, 2, norm="batch")


_sgd = sgd


def _meta_model():
    with torch.device("meta"):
        return nn.Linear(4, 4)


class _IntegerOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4))


def _foreign_optimizer(m):
    return _sgd(_net())  # a different model's parameters


# (id, the call given a fresh model, exception type, message pattern)
ROWS = [
    ("unknown-opt-level", lambda m: amp_patch.initialize(m, _sgd(m), "O8"),
     ConfigError, r"opt_level='O8' is not an opt level; use one of O0, O1, O2, O3, O4, O5, O6, O7"),
    ("zero-for-letter-O", lambda m: amp_patch.initialize(m, _sgd(m), "01"),
     ConfigError, r"opt_level='01' is not an opt level \(the letter O, not zero\)"),
    ("unknown-keyword", lambda m: amp_patch.initialize(m, _sgd(m), "O1", loss_scal=128),
     ConfigError, r"unknown option 'loss_scal' \(did you mean 'loss_scale'\?\)"),
    ("misspelled-opt-level-keyword", lambda m: amp_patch.initialize(m, _sgd(m), opt_levl="O2"),
     ConfigError, r"unknown option 'opt_levl' \(did you mean 'opt_level'\?\) for initialize"),
    ("misspelled-half-dtype-keyword", lambda m: amp_patch.initialize(m, _sgd(m), "O1", half_dtyp="bfloat16"),
     ConfigError, r"unknown option 'half_dtyp' \(did you mean 'half_dtype'\?\)"),
    ("model-not-a-module", lambda m: amp_patch.initialize("model.pt", _sgd(m), "O1"),
     ConfigError, r"models is a builtins\.str; initialize expects torch\.nn\.Module"),
    ("optimizer-is-a-generator", lambda m: amp_patch.initialize(m, m.parameters(), "O1"),
     ConfigError, r"optimizers is a builtins\.generator; initialize expects torch\.optim\.Optimizer"),
    ("optimizer-list-with-a-module", lambda m: amp_patch.initialize(m, [_sgd(m), m], "O1"),
     ConfigError, r"optimizers\[1\] is a torch\.nn\.modules\.container\.Sequential"),
    ("half-dtype-float64", lambda m: amp_patch.initialize(m, _sgd(m), "O1", half_dtype=torch.float64),
     ConfigError, r"half_dtype=torch\.float64 is not supported; use one of torch\.float16, torch\.bfloat16"),
    ("half-dtype-typo", lambda m: amp_patch.initialize(m, _sgd(m), "O1", half_dtype="bf61"),
     ConfigError, r"half_dtype='bf61' is not supported"),
    ("fp16-master-weights-half-model", lambda m: amp_patch.initialize(m.half(), _sgd(m), "O1"),
     ConfigError, r"is torch\.float16: the optimizer would update half-precision weights directly \(FP16 master weights\)"),
    ("fp16-master-weights-keyword", lambda m: amp_patch.initialize(m, _sgd(m), "O2", master_weights=torch.float16),
     ConfigError, r"master_weights=torch\.float16 must be True, False or None"),
    ("master-weights-without-half-model", lambda m: amp_patch.initialize(m, _sgd(m), "O1", master_weights=True),
     ConfigError, r"master_weights=True with cast_model_type=\w+ .*drop master_weights"),
    ("optimizer-over-other-parameters", lambda m: amp_patch.initialize(m, _foreign_optimizer(m), "O2"),
     ConfigError, r"param_groups\[0\]\['params'\]\[0\] \(shape \[8, 4\]\) is not a parameter of the model\(s\) passed to initialize"),
    ("model-on-meta-device", lambda m: amp_patch.initialize(_meta_model(), None, "O2"),
     ConfigError, r"model 0 \(Linear\) has tensors on the meta device\. Materialize it first \(model\.to_empty"),
    ("model-without-floating-parameters", lambda m: amp_patch.initialize(_IntegerOnly(), None, "O2"),
     ConfigError, r"model 0 \(_IntegerOnly\) has no floating-point parameters.*Use O1/O4"),
    ("o2-without-a-model", lambda m: amp_patch.initialize(None, None, "O2"),
     ConfigError, r"opt_level='O2' casts the model, so initialize needs the model"),
    ("negative-loss-scale", lambda m: amp_patch.initialize(m, _sgd(m), "O1", loss_scale=-1),
     ConfigError, r"loss_scale=-1 is not a loss scale; use 'dynamic' or a positive, finite number"),
    ("growth-factor-not-above-1", lambda m: amp_patch.initialize(m, _sgd(m), "O1", half_dtype=f16, growth_factor=1.0),
     ValueError, r"growth_factor=1\.0 must be > 1"),
    ("backoff-outside-0-1", lambda m: amp_patch.initialize(m, _sgd(m), "O1", half_dtype=f16, backoff_factor=1.5),
     ValueError, r"backoff_factor=1\.5 must be in \(0, 1\)"),
    ("keep-batchnorm-not-a-bool", lambda m: amp_patch.initialize(m, _sgd(m), "O2", keep_batchnorm_fp32="maybe"),
     ConfigError, r"keep_batchnorm_fp32='maybe' must be True, False or None"),
    ("cast-model-type-int8", lambda m: amp_patch.initialize(m, _sgd(m), "O2", cast_model_type=torch.int8),
     ConfigError, r"cast_model_type=torch\.int8 is not supported"),
    ("zero-losses", lambda m: amp_patch.initialize(m, _sgd(m), "O1", num_losses=0),
     ConfigError, r"num_losses=0 must be an integer >= 1"),
    ("lists-not-a-path", lambda m: amp_patch.initialize(m, _sgd(m), "O1", lists=42),
     ListError, r"lists= takes a YAML path, a dict, or a list of them; got int"),
    ("keep-fp32-at-o1", lambda m: amp_patch.initialize(m, _sgd(m), "O1", keep_fp32=["0"]),
     ConfigError, r"keep_fp32 .* use it with O2, O3 or O5"),
    ("opt-level-in-a-list", lambda m: amp_patch.initialize(m, _sgd(m), ["O1"]),
     ConfigError, r"opt_level=\['O1'\] is a list, not an opt level; pass one string"),
    ("lists-at-a-model-level", lambda m: amp_patch.initialize(m, _sgd(m), "O2", lists={"torch": {"float": ["mm"]}}),
     ConfigError, r"lists= overrides the op lists, but opt_level='O2' patches no functions"),
    ("fused-update-not-a-bool", lambda m: amp_patch.initialize(m, _sgd(m), "O2", fused_update="yes"),
     ConfigError, r"fused_update='yes' must be True or False"),
    ("enabled-not-a-bool", lambda m: amp_patch.initialize(m, _sgd(m), "O1", enabled="no"),
     ConfigError, r"enabled='no' must be True or False"),
    ("save-dtype-float64", lambda m: amp_patch.initialize(m, _sgd(m), "O2", save_dtype=torch.float64),
     ConfigError, r"save_dtype=torch\.float64 is not supported"),
    ("keep-fp32-a-number", lambda m: amp_patch.initialize(m, _sgd(m), "O2", keep_fp32=3),
     ConfigError, r"keep_fp32=3 must be a callable \(module, name\) -> bool or a list of module-name patterns"),
]


@pytest.mark.parametrize("call,exc,pattern", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_initialize_raises_clearly_and_changes_nothing(call, exc, pattern):
    model = _net()
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before = Snapshot()
    with pytest.raises(exc, match=pattern) as info:
        call(model)
    assert isinstance(info.value, amp_patch.AmpError)
    assert not amp_patch.is_initialized()
    assert before.changed() == []
    # The model is as it was (rows that build their own model leave this one alone too).
    after_model = model.state_dict()
    for k, v in before_model.items():
        if k in after_model and after_model[k].dtype == v.dtype:
            assert torch.equal(after_model[k], v), k


def test_a_second_initialize_with_other_settings_is_refused_and_keeps_the_first():
    a, b = _net(), _net()
    amp_patch.initialize(a, _sgd(a), "O1", half_dtype=bf16)
    try:
        during = Snapshot()
        with pytest.raises(ConfigError, match=r"already initialized with opt_level='O1'.*deinitialize\(\) first"):
            amp_patch.initialize(b, _sgd(b), "O2", half_dtype=bf16)
        assert during.changed() == []
        assert all(p.dtype == torch.float32 for p in b.parameters())
        assert F.linear(torch.randn(2, 4), a[0].weight).dtype == bf16  # the first run is still on
    finally:
        amp_patch.deinitialize()


# ---------------------------------------------------------------- wrong call order

ORDER_ROWS = [
    ("scale_loss", lambda opt: amp_patch.scale_loss(torch.ones(()), opt).__enter__()),
    ("master_params", lambda opt: list(amp_patch.master_params(opt))),
    ("unscale_", lambda opt: amp_patch.unscale_(opt)),
    ("state_dict", lambda opt: amp_patch.state_dict()),
    ("load_state_dict", lambda opt: amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})),
]


@pytest.mark.quick
@pytest.mark.parametrize("name,call", ORDER_ROWS, ids=[r[0] for r in ORDER_ROWS])
def test_calls_before_initialize_say_to_initialize_first(name, call):
    before = Snapshot()
    with pytest.raises(StateError, match=rf"amp_patch\.{name} needs amp_patch\.initialize\(model, optimizer"):
        call(_sgd(_net()))
    assert before.changed() == [] and not amp_patch.is_initialized()


def test_scale_loss_with_an_optimizer_initialize_never_saw():
    m = _net()
    amp_patch.initialize(m, _sgd(m), "O1", half_dtype=f16)
    try:
        stranger = _sgd(m)
        with pytest.raises(StateError, match=r"this SGD was not passed to initialize.*adopt_optimizer"):
            with amp_patch.scale_loss(m(torch.randn(4, 4)).float().sum(), stranger):
                pass
        with pytest.raises(ConfigError, match=r"loss_id=3 must be an integer in \[0, 1\)"):
            with amp_patch.scale_loss(torch.ones(()), _first_optimizer(), loss_id=3):
                pass
    finally:
        amp_patch.deinitialize()


def _first_optimizer():
    from amp_patch.base import running

    return running.session().optimizers[0]


def test_deinitialize_inside_scale_loss_is_refused_then_works_after_the_block():
    m = _net()
    opt = _sgd(m)
    amp_patch.initialize(m, opt, "O1", half_dtype=f16)
    try:
        loss = F.mse_loss(m(torch.randn(4, 4)).float(), torch.zeros(4, 2))
        with amp_patch.scale_loss(loss, opt) as scaled:
            with pytest.raises(StateError, match=r"deinitialize\(\) was called inside a `with amp_patch\.scale_loss"):
                amp_patch.deinitialize()
            assert amp_patch.is_initialized()
            scaled.backward()
        opt.step()
    finally:
        amp_patch.deinitialize()
    assert not amp_patch.is_initialized()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_twice_without_backward_never_applies_skipped_gradients(level):
    model = nn.Linear(4, 4)
    opt = _sgd(model)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=f16, verbosity=0)
    try:
        x = torch.randn(2, 4)
        x[0, 0] = float("inf")
        opt.zero_grad()
        F.mse_loss(model(x).float(), torch.zeros(2, 4)).backward()
        opt.step()  # skipped: the gradients are inf/NaN
        kept = {k: v.clone() for k, v in model.state_dict().items()}
        assert amp_patch.counters()["skipped"] == 1
        try:
            opt.step()  # no backward since the skipped step
        except StateError as e:
            assert "step" in str(e) and "backward" in str(e)
        state = model.state_dict()
        for k in kept:
            assert torch.equal(state[k], kept[k]), f"a second step applied the skipped gradients to {k}"
        assert all(torch.isfinite(p).all() for p in amp_patch.master_params(opt))
    finally:
        amp_patch.deinitialize()


def test_step_twice_without_backward_is_refused_or_matches_fp32():
    torch.manual_seed(1)
    ref = nn.Linear(4, 4)
    model = copy.deepcopy(ref)
    x = torch.randn(2, 4)
    ref_opt = _sgd(ref)
    F.mse_loss(ref(x), torch.zeros(2, 4)).backward()
    ref_opt.step()
    ref_opt.step()  # plain PyTorch applies the same gradients again
    opt = _sgd(model)
    amp_patch.initialize(model, opt, "O1", half_dtype=f16)
    try:
        with amp_patch.disable_casts():  # FP32 forward, so only the scaling differs from ref
            loss = F.mse_loss(model(x), torch.zeros(2, 4))
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        try:
            opt.step()
        except StateError as e:
            assert "step" in str(e) and "backward" in str(e)
            return
        # Not refused: then it must be what FP32 does, with true (unscaled) gradients.
        torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7)
    finally:
        amp_patch.deinitialize()


def test_an_o1_checkpoint_loads_into_o2():
    torch.manual_seed(2)
    model = _net()
    opt = _sgd(model)
    amp_patch.initialize(model, opt, "O1", half_dtype=f16, verbosity=0)
    try:
        for i in range(3):
            x = torch.randn(4, 4)
            if i == 1:
                x[0, 0] = float("inf")  # one overflow, so the saved scale is not the default
            opt.zero_grad()
            F.mse_loss(model(x).float(), torch.zeros(4, 2)).backward()
            opt.step()
        ckpt = {"model": copy.deepcopy(model.state_dict()), "amp": amp_patch.state_dict()}
        scale = amp_patch.counters()["loss_scale"][0]
    finally:
        amp_patch.deinitialize()
    assert scale == 2.0 ** 15

    fresh = _net()
    opt2 = _sgd(fresh)
    fresh, opt2 = amp_patch.initialize(fresh, opt2, "O2", half_dtype=f16, verbosity=0)
    try:
        fresh.load_state_dict(ckpt["model"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            amp_patch.load_state_dict(ckpt["amp"])
        # It works, and says what it did with a checkpoint of another level.
        assert any("opt_level='O1'" in str(w.message) for w in caught)
        assert amp_patch.counters()["loss_scale"][0] == scale
        masters = list(amp_patch.master_params(opt2))
        assert torch.equal(masters[0], ckpt["model"]["0.weight"])
        assert fresh[0].weight.dtype == f16 and torch.equal(fresh[0].weight, ckpt["model"]["0.weight"].half())
        assert torch.equal(fresh.state_dict()["0.weight"], ckpt["model"]["0.weight"])
    finally:
        amp_patch.deinitialize()


def test_load_state_dict_of_garbage_says_what_it_wanted():
    m = _net()
    amp_patch.initialize(m, _sgd(m), "O1", half_dtype=f16)
    try:
        with pytest.raises(ConfigError, match=r"no loss scaler state in the dict .*amp_patch\.state_dict\(\)"):
            amp_patch.load_state_dict({"model": {}})
        with pytest.raises(ConfigError, match=r"expects the dict amp_patch\.state_dict\(\) returned, got list"):
            amp_patch.load_state_dict([1, 2])
        with pytest.raises(ConfigError, match=r"checkpoint has 2 loss scaler\(s\), this run has 1; pass initialize\(\.\.\., num_losses=2\)"):
            amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 8.0}, "loss_scaler1": {"loss_scale": 8.0}})
        assert amp_patch.counters()["loss_scale"] == [2.0 ** 16]  # nothing half-loaded
    finally:
        amp_patch.deinitialize()


# ---------------------------------------------------------------- op lists


def _write(path, content):
    """Write text or bytes to ``path``; return the path as a string."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


BOMB = "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
    for p, c in zip([None, "a", "b", "c", "d", "e", "f", "g", "h"], "abcdefghi")
)

# Each row: id, the source (file content, written to l.yaml; a dict, given as
# it is; or a callable that makes it in a temporary directory), the error pattern.
LIST_ROWS = [
    ("unknown-namespace", "torch.nn.functionl:\n  half: [linear]\n",
     r"l\.yaml:1: 'torch\.nn\.functionl' is not a known namespace; did you mean 'torch\.nn\.functional'\?"),
    ("unknown-policy", "torch.nn.functional:\n  halff: [linear]\n",
     r"l\.yaml:2: torch\.nn\.functional\.halff is not a policy; did you mean 'half'\?"),
    ("unknown-op", "torch.nn.functional:\n  float: [sofmax]\n",
     r"l\.yaml:2: torch\.nn\.functional\.float\[0\] 'sofmax' is not in torch\.nn\.functional; did you mean 'softmax'\?"),
    ("op-under-two-policies", "torch:\n  float: [mm]\n  half: [mm]\n",
     r"l\.yaml:3: torch\.half 'mm' is under two policies \('float' at .*l\.yaml:2\)"),
    ("unknown-entry-key", "torch:\n  float:\n    - {name: mm, wen: {dtype: float16}}\n",
     r"l\.yaml:3: torch\.float\[0\] has unknown key 'wen'; did you mean 'when'\?"),
    ("bad-when-value", "torch:\n  float:\n    - {name: mm, when: {dtype: float8}}\n",
     r"'when\.dtype' of 'mm' is 'float8'; did you mean 'float16'\?"),
    ("not-a-mapping", "- torch\n- half\n",
     r"l\.yaml:1: must be a mapping of namespaces"),
    ("malformed-yaml", "torch:\n  float: [mm\n",
     r"l\.yaml:3: malformed YAML"),
    ("huge-file", "torch:\n  float: [mm]\n" + "# pad\n" * 200_000,
     r"l\.yaml: is \d+ bytes; an op list must be under 1048576 bytes"),
    ("utf16-encoding", "torch:\n  float: [mm]\n".encode("utf-16"),
     r"l\.yaml: is not UTF-8 text \(byte 0\); save the file as UTF-8"),
    ("latin1-encoding", "# café\ntorch:\n  float: [mm]\n".encode("latin-1"),
     r"l\.yaml: is not UTF-8 text \(byte 5\)"),
    ("yaml-bomb", BOMB,
     r"l\.yaml:\d+: YAML anchors and aliases are not allowed in op lists"),
    ("python-tag", lambda d: _write(d / "l.yaml", f'torch:\n  float: !!python/object/apply:os.system ["touch {d}/pwned"]\n'),
     r"l\.yaml:2: YAML tag 'tag:yaml\.org,2002:python/object/apply:os\.system' is not allowed"),
    ("dangling-symlink", lambda d: (os.symlink(d / "nowhere.yaml", d / "l.yaml"), str(d / "l.yaml"))[1],
     r"l\.yaml: is a symbolic link to '.*nowhere\.yaml', which does not exist"),
    ("a-directory", lambda d: (os.mkdir(d / "l.yaml"), str(d / "l.yaml"))[1],
     r"l\.yaml: cannot be read"),
    ("missing-file", lambda d: str(d / "l.yaml"),
     r"l\.yaml: no such op-list file; check the path given to lists= or AMP_PATCH_LISTS"),
    ("dict-with-unknown-op", {"torch": {"half": ["not_an_op_xyz"]}},
     r"<lists dict>: torch\.half\[0\] 'not_an_op_xyz' is not in torch"),
    ("policy-given-as-a-mapping", "torch:\n  float:\n    mm: yes\n",
     r"l\.yaml:2: torch\.float is a mapping; it must be a list of op names: write `float: \[mm\]`"),
    ("op-under-another-namespace", "torch.nn.functional:\n  float: [matmul]\n",
     r"l\.yaml:2: torch\.nn\.functional\.float\[0\] 'matmul' is not in torch\.nn\.functional; it is in torch "
     r"\(also in torch\.Tensor, torch\.linalg\): list it under torch:"),
    ("attribute-protocol-dunder", "torch.Tensor:\n  float: [__getattribute__]\n",
     r"torch\.Tensor\.__getattribute__ is serialization, random state, configuration or the object protocol, not a tensor op"),
    ("serialization-function", "torch:\n  half: [save]\n",
     r"torch\.save is serialization, random state, configuration or the object protocol, not a tensor op"),
    ("a-class", "torch:\n  half: [Tensor]\n",
     r"torch\.Tensor is a class, not a tensor op"),
    ("remove-of-an-unlisted-op", "torch.nn.functional:\n  remove: [gelu]\n",
     r"l\.yaml:2: torch\.nn\.functional\.remove 'gelu' is on no list, so there is nothing to remove"),
]


@pytest.mark.parametrize("source,pattern", [r[1:] for r in LIST_ROWS], ids=[r[0] for r in LIST_ROWS])
@pytest.mark.parametrize("via", ["argument", "environment"])
def test_bad_op_lists_raise_before_anything_is_patched(tmp_path, monkeypatch, source, pattern, via):
    if callable(source):
        src = source(tmp_path)
    elif isinstance(source, (str, bytes)):
        src = _write(tmp_path / "l.yaml", source)
    else:
        src = source
    if via == "environment":
        if isinstance(src, dict):
            pytest.skip("a dict cannot be given through the environment")
        monkeypatch.setenv("AMP_PATCH_LISTS", src)
        src = None
    m = _net()
    before = Snapshot()
    with pytest.raises(ListError, match=pattern):
        amp_patch.initialize(m, _sgd(m), "O1", half_dtype=f16, lists=src)
    assert before.changed() == [] and not amp_patch.is_initialized()
    assert not (tmp_path / "pwned").exists()


def test_every_problem_in_a_list_is_reported_at_once(tmp_path):
    src = _write(tmp_path / "many.yaml", "torch:\n  float: [mmm]\n  halff: [bmm]\ntorch.nn.functional:\n  half: [linearr]\n")
    with pytest.raises(ListError, match=r"3 problems in op lists") as info:
        amp_patch.initialize(None, None, "O1", lists=src)
    text = str(info.value)
    assert "'mmm'" in text and "halff" in text and "'linearr'" in text and "did you mean 'linear'" in text


# ---------------------------------------------------------------- numerical faults


def _mlp():
    return mlp(4, 16, 2, seed=3)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_nan_input_for_one_step_is_skipped_and_training_continues(level):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=f16, verbosity=0)
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    try:
        losses, states = [], []
        for step in range(12):
            xb = x.clone()
            if step == 5:
                xb[3, 1] = float("nan")
            opt.zero_grad()
            loss = F.mse_loss(model(xb).float(), t)
            loss.backward()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            opt.step()
            states.append((before, {k: v.clone() for k, v in model.state_dict().items()}))
            losses.append(loss.item())
        c = amp_patch.counters()
        assert c["skipped"] == 1 and c["steps"] == 11
        assert c["loss_scale"] == [2.0 ** 15]
        before, after = states[5]
        assert all(torch.equal(before[k], after[k]) for k in before)  # the NaN step changed nothing
        before, after = states[6]
        assert not torch.equal(before["0.weight"], after["0.weight"])  # the next one trains again
        assert all(torch.isfinite(v).all() for v in after.values())
        finite = [v for i, v in enumerate(losses) if i != 5]
        assert finite[-1] < finite[0]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_nan_every_step_stops_with_a_clear_error_after_the_configured_skips(level):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=f16, init_scale=8.0,
                                      max_consecutive_skips=3, verbosity=0)
    try:
        steps = 0
        with pytest.raises(OverflowLoopError) as info:
            for steps in range(1, 50):
                opt.zero_grad()
                F.mse_loss(model(torch.full((4, 4), float("nan"))).float(), torch.zeros(4, 2)).backward()
                opt.step()
        # 8 -> 4 -> 2 -> 1 takes three skips, then three more at the minimum.
        assert steps == 6
        msg = str(info.value)
        for part in ("inf/NaN", "minimum", "find_overflow=True", "'float'", "bfloat16", "learning rate",
                     "max_consecutive_skips=3"):
            assert part in msg, part
        state = model.state_dict()
        assert all(torch.equal(state[k], start[k]) for k in start)  # no NaN ever reached the weights
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("where", ["model", "master"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inf_written_into_a_weight_is_detected(level, where):
    if where == "master" and level == "O1":
        pytest.skip("O1 has no separate masters")
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=f16, init_scale=4.0,
                                      max_consecutive_skips=3, verbosity=0)
    try:
        with torch.no_grad():  # the bad manual edit
            target = next(iter(amp_patch.master_params(opt))) if where == "master" else model[0].weight
            target[0, 0] = float("inf")
        edited = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.rand(4, 4) + 0.5  # positive inputs: the inf reaches the output every time
        with pytest.raises(OverflowLoopError, match=r"inf/NaN gradients"):
            for _ in range(20):
                opt.zero_grad()
                F.mse_loss(model(x).float(), torch.zeros(4, 2)).backward()
                opt.step()
        c = amp_patch.counters()
        # an edit of the master reaches the half model before its next forward, as an edit
        # of the model reaches the master before the step: the first step already overflows
        assert c["skipped"] >= 3 and c["steps"] == 0
        assert not torch.isfinite(model[0].weight).all()
        state = model.state_dict()
        for k in edited:
            if k != "0.weight":
                assert torch.equal(state[k], edited[k]), k  # nothing else was touched
    finally:
        amp_patch.deinitialize()


# ---------------------------------------------------------------- exceptions inside a training step


def _same_objects(a, b):
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class _Boom(Exception):
    pass


def _explode(where, at):
    if where == at:
        raise _Boom(where)


@pytest.mark.parametrize("level,half", [("O1", f16), ("O1", bf16), ("O2", f16), ("O5", bf16)])
@pytest.mark.parametrize("where", ["forward", "inside-scale_loss", "after-backward", "inside-disable_casts", "in-a-hook"])
def test_deinitialize_after_an_exception_in_the_step_restores_everything(level, half, where):
    model = _net()
    fp32_params = [p for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = Snapshot()
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=half, verbosity=0)
    handle = model[2].register_forward_hook(lambda m, i, o: _explode(where, "in-a-hook"))
    x, t = torch.randn(4, 4), torch.randn(4, 2)
    try:
        with pytest.raises(_Boom):
            for _ in range(2):
                opt.zero_grad()
                out = model(x)
                _explode(where, "forward")
                loss = F.mse_loss(out.float(), t)
                with amp_patch.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                    _explode(where, "inside-scale_loss")
                _explode(where, "after-backward")
                with amp_patch.disable_casts():
                    _explode(where, "inside-disable_casts")
                opt.step()
    finally:
        handle.remove()
        amp_patch.deinitialize()
    assert before.changed() == []
    from amp_patch.patching import wrappers

    assert not wrappers.disabled  # the disable_casts block was left on the way out
    assert _same_objects(model.parameters(), fp32_params)  # the same tensors, back in FP32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _same_objects(opt.param_groups[0]["params"], fp32_params)
    # And a fresh run works.
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=half, verbosity=0)
    try:
        opt.zero_grad()
        F.mse_loss(model(x).float(), t).backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in amp_patch.master_params(opt))
    finally:
        amp_patch.deinitialize()


# ------------------------------------------------------------------ small inputs that used to escape as torch's or Python's errors


def test_an_opt_level_that_is_no_string_is_refused_by_name():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(amp_patch.ConfigError, match=r"opt_level=\['O1'\] is a list, not an opt level; pass one string"):
        amp_patch.initialize(model, None, ["O1"])
    assert not amp_patch.is_initialized()


@pytest.mark.parametrize("verbosity", ["loud", -1, True, 1.5])
def test_a_bad_verbosity_is_refused(verbosity):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(amp_patch.ConfigError, match=r"verbosity=.* must be an integer >= 0"):
        amp_patch.initialize(model, None, "O1", verbosity=verbosity)
    assert not amp_patch.is_initialized()


def test_scale_loss_of_a_number_names_the_fix():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, verbosity=0)
    try:
        with pytest.raises(amp_patch.ConfigError, match=r"scale_loss: the loss must be a tensor .* got float 1.0"):
            with amp_patch.scale_loss(1.0, opt):
                pass
    finally:
        amp_patch.deinitialize()
