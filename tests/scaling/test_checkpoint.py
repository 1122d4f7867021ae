"""Checkpoints of half-precision models: FP32 state dicts from the masters,
loading into the masters, and bit-exact resume in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import amp_patch
from amp_patch.base.errors import StateError
from helpers import amp

bf16, f32 = torch.bfloat16, torch.float32

# The first pickling of a tensor in a process caches copyreg's __slotnames__ on
# torch.Tensor; do it now so the leak check around each test does not see it.
torch.save(torch.zeros(1), __import__("io").BytesIO())

# The same recipe runs here and in the fresh process that resumes.
RECIPE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    import amp_patch

    CONFIGS = {
        "o2_fp16": dict(opt_level="O2", half_dtype=torch.float16, init_scale=2.0**14, growth_interval=3),
        "o2_bf16": dict(opt_level="O2", half_dtype=torch.bfloat16),
        "o1_fp16": dict(opt_level="O1", half_dtype=torch.float16, growth_interval=3),
        "o5_fused": dict(opt_level="O5", fused_update=True),
        "o2_fp16_fused": dict(opt_level="O2", half_dtype=torch.float16, init_scale=2.0**14, growth_interval=3,
                              fused_update=True),
    }


    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


    def start(cfg):
        model, opt = build()
        return amp_patch.initialize(model, opt, verbosity=0, **CONFIGS[cfg])


    def step(model, opt, i, cfg):
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        if i == 2 and "fp16" in cfg:
            loss = loss * float("inf")  # a skipped step, and the scale backs off
        loss.backward()
        opt.step()


    def snapshot(model, opt):
        return {"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict()}


    def resume(directory, first, last):
        out = {}
        for cfg in CONFIGS:
            ckpt = torch.load(f"{directory}/ckpt_{cfg}.pt", weights_only=True)
            model, opt = start(cfg)
            try:
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
                amp_patch.load_state_dict(ckpt["amp"])
                for i in range(first, last):
                    step(model, opt, i, cfg)
                out[cfg] = snapshot(model, opt)
            finally:
                amp_patch.deinitialize()
        torch.save(out, f"{directory}/resumed.pt")


    if __name__ == "__main__":
        import sys

        resume(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    """
)
recipe: dict = {}
exec(compile(RECIPE, "<recipe>", "exec"), recipe)


def trained_o2(steps=3, **kwargs):
    model, opt = recipe["build"]()
    amp_patch.initialize(model, opt, "O2", verbosity=0, **kwargs)
    for i in range(steps):
        recipe["step"](model, opt, i, "o2_bf16")
    return model, opt


def equal_trees(a, b, path="") -> list:
    """Paths where two nested state dicts differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [p for k in a for p in equal_trees(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in equal_trees(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# ------------------------------------------------------------------ state_dict


@pytest.mark.quick
def test_state_dict_is_fp32_from_the_masters_and_loads_into_a_plain_model():
    model, opt = trained_o2()
    try:
        masters = list(amp_patch.master_params(opt))
        sd = model.state_dict()
        assert {k: v.dtype for k, v in sd.items()} == {k: v.dtype for k, v in recipe["build"]()[0].state_dict().items()}
        # the half-cast layers come from their masters, exactly (not the rounded half values)
        for key, m in zip(["0.weight", "0.bias", "3.weight", "3.bias"], [masters[0], masters[1], masters[4], masters[5]]):
            assert torch.equal(sd[key], m) and not torch.equal(sd[key], sd[key].to(bf16).float())
        # a submodule's own state dict is converted too
        assert torch.equal(model[0].state_dict()["weight"], masters[0])
        kept = model.state_dict(keep_vars=True)
        assert kept["0.weight"] is masters[0] and kept["1.weight"] is model[1].weight
    finally:
        amp_patch.deinitialize()
    plain = recipe["build"]()[0]
    plain.load_state_dict(sd)  # strict: same keys, same dtypes as FP32 training
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in sd.items())


def test_save_dtype_chooses_what_the_state_dict_holds():
    model, opt = trained_o2(save_dtype="bfloat16")
    try:
        sd = model.state_dict()
        assert sd["0.weight"].dtype == bf16 and torch.equal(sd["0.weight"], model[0].weight.detach())
        assert sd["1.running_mean"].dtype == f32  # kept FP32, saved as it is
    finally:
        amp_patch.deinitialize()


@pytest.mark.quick
def test_load_state_dict_after_initialize_sets_the_masters_exactly():
    source, _ = recipe["build"]()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # values BF16 cannot hold
    state = source.state_dict()
    model, opt = recipe["build"]()
    with amp(model, opt, "O2"):
        model.load_state_dict(state)
        masters = list(amp_patch.master_params(opt))
        for m, (k, p) in zip(masters, [(k, v) for k, v in source.named_parameters()]):
            assert torch.equal(m, p)
        assert torch.equal(model[0].weight, state["0.weight"].to(bf16))
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        with pytest.raises(StateError, match="assign=True"):
            model.load_state_dict(state, assign=True)


def test_optimizer_state_dict_round_trips_onto_the_masters():
    model, opt = trained_o2()
    try:
        saved = opt.state_dict()
    finally:
        amp_patch.deinitialize()
    model2, opt2 = recipe["build"]()
    with amp(model2, opt2, "O2"):
        opt2.load_state_dict(saved)
        masters = list(amp_patch.master_params(opt2))
        assert all(m in opt2.state and opt2.state[m]["exp_avg"].dtype == f32 for m in masters)
        assert not equal_trees(opt2.state_dict(), saved)


# ------------------------------------------------------------------ resume


def test_resume_in_a_fresh_process_is_bit_exact(tmp_path):
    first, last = 3, 6  # the overflow (step 2) before the save, a scale growth after it
    uninterrupted = {}
    for cfg in recipe["CONFIGS"]:
        model, opt = recipe["start"](cfg)
        try:
            for i in range(last):
                if i == first:
                    torch.save(recipe["snapshot"](model, opt), tmp_path / f"ckpt_{cfg}.pt")
                recipe["step"](model, opt, i, cfg)
            uninterrupted[cfg] = recipe["snapshot"](model, opt)
            if "fp16" in cfg:
                assert amp_patch.counters()["skipped"] == 1
        finally:
            amp_patch.deinitialize()
    worker = tmp_path / "worker.py"
    worker.write_text(RECIPE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), str(first), str(last)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for cfg in recipe["CONFIGS"]:
        diff = equal_trees(uninterrupted[cfg], resumed[cfg], cfg)
        assert not diff, diff[:5]


# ------------------------------------------------------------------ checkpoints across dtypes and policies


def _amp_state(level, **kw):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, level, verbosity=0, **kw)
    return model, opt


def test_a_bf16_checkpoint_keeps_the_fp16_runs_dynamic_scale():
    """The CPU-to-GPU resume: a BF16 run's scale 1 must not become the FP16 run's dynamic scale."""
    _amp_state("O4")
    saved = amp_patch.state_dict()
    amp_patch.deinitialize()
    assert saved["loss_scaler0"]["dynamic"] is False and saved["amp_patch"]["half_dtype"] == "bfloat16"
    _amp_state("O1", half_dtype=torch.float16)
    try:
        with pytest.warns(amp_patch.AmpWarning, match=r"saved by a bfloat16 run and this run is float16.*loss scaler 0: the "
                          r"checkpoint's loss scale is static \(1\) and this run's is dynamic: kept this run's dynamic scale 65536") as rec:
            amp_patch.load_state_dict(saved)
        assert rec[0].filename == __file__  # points at the caller's line
        assert amp_patch.counters()["loss_scale"] == [65536.0]
    finally:
        amp_patch.deinitialize()


def test_an_fp16_checkpoint_does_not_switch_on_scaling_under_bf16():
    _amp_state("O1", half_dtype=torch.float16)
    saved = amp_patch.state_dict()
    amp_patch.deinitialize()
    _amp_state("O4")
    try:
        with pytest.warns(amp_patch.AmpWarning, match=r"the checkpoint's loss scale is dynamic \(65536\) and this run's is static: kept this run's static scale 1"):
            amp_patch.load_state_dict(saved)
        assert amp_patch.counters()["loss_scale"] == [1.0]
    finally:
        amp_patch.deinitialize()


def test_a_scale_outside_the_runs_range_is_clamped_with_a_warning():
    _amp_state("O1", half_dtype=torch.float16, max_loss_scale=2.0**20)
    try:
        state = amp_patch.state_dict()
        state["loss_scaler0"] = dict(state["loss_scaler0"], loss_scale=1e300)
        with pytest.warns(amp_patch.AmpWarning, match=r"loss scale 1e\+300 lies outside this run's \[min_loss_scale, max_loss_scale\] = \[1, 1.04858e\+06\]: clamped to 1.04858e\+06"):
            amp_patch.load_state_dict(state)
        assert amp_patch.counters()["loss_scale"] == [2.0**20]
        state["loss_scaler0"]["loss_scale"] = float("inf")
        with pytest.raises(amp_patch.ConfigError, match="loss_scale=inf must be finite"):
            amp_patch.load_state_dict(state)
        assert amp_patch.counters()["loss_scale"] == [2.0**20]
    finally:
        amp_patch.deinitialize()


def _warning_of(state) -> str:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        amp_patch.load_state_dict(state)
    (w,) = [w for w in rec if issubclass(w.category, amp_patch.AmpWarning)]
    return str(w.message)


def test_the_warning_says_what_was_kept_and_what_was_loaded():
    """As the guide promises: the one warning names what differs, what this run kept
    and what came from the checkpoint."""
    _amp_state("O4")
    try:
        saved = amp_patch.state_dict()
        saved["loss_scaler0"]["steps"], saved["loss_scaler0"]["skipped"] = 7, 2
    finally:
        amp_patch.deinitialize()
    _amp_state("O1", half_dtype=torch.float16)
    try:
        msg = _warning_of(saved)
        assert msg.endswith(
            ". Kept: this run's half dtype, float16; this run's opt_level, 'O1'; loss scaler 0's dynamic scale 65536. "
            "Loaded: loss scaler 0's step counters (7 steps, 2 skipped).")
        assert msg.startswith("amp_patch.load_state_dict: the checkpoint was saved by a bfloat16 run and this run is float16; ")
    finally:
        amp_patch.deinitialize()
    _amp_state("O2", half_dtype=torch.float16, max_loss_scale=2.0**20)
    try:
        state = amp_patch.state_dict()
        state["loss_scaler0"] = dict(state["loss_scaler0"], loss_scale=1e300)
        state["amp_patch"]["opt_level"] = "O1"
        msg = _warning_of(state)
        assert msg.endswith(
            ". Kept: this run's opt_level, 'O2'; loss scaler 0's range [1, 1.04858e+06]. "
            "Loaded: loss scaler 0's scale (as 1.04858e+06) and step counters (0 steps, 0 skipped); "
            "the attention precisions chosen so far.")  # O2's cast_policy="auto" saves them
    finally:
        amp_patch.deinitialize()


def test_a_matching_checkpoint_loads_without_a_word():
    _amp_state("O1", half_dtype=torch.float16)
    try:
        saved = amp_patch.state_dict()
        saved["loss_scaler0"]["loss_scale"] = 1024.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            amp_patch.load_state_dict(saved)
        assert amp_patch.counters()["loss_scale"] == [1024.0]
    finally:
        amp_patch.deinitialize()
