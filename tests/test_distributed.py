"""torch.distributed under amp_patch: DDP and FSDP with gloo, two CPU processes.

Two worker processes (this file run as a script) train every scenario below
once and save what they ended with; the tests compare the ranks' results.
One pair of processes serves the whole module, because starting them (and
importing torch twice) is most of the cost.

Scenarios:
  * DDP under O1..O5, FP16 and BF16: the ranks end bitwise identical.
  * ``no_sync()`` accumulation: true gradients after every micro-batch, and
    the all-reduce of the whole sum at the last (compared with FP32).
  * An inf on one rank only: every rank skips the same step (DDP's all-reduce
    spreads it; with ``no_sync()`` accumulation, and with unrelated models per
    rank, amp_patch all-reduces the overflow flag itself).
  * FSDP ``fully_shard`` under O1 (function patching) trains and matches DDP;
    O3 on a ``fully_shard`` model and O2 on a ``FullyShardedDataParallel`` one
    are refused at ``initialize`` with a message that names the alternatives
    (O2/O5 on ``fully_shard``: ``test_fsdp.py``).
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import Snapshot, case_results, mlp, run_workers, serve_cases

WORLD = 2
STEPS = 5
BAD_STEP = 2  # the step (0-based) at which rank 1 sees an inf
DDP_CASES = [
    ("O1", "float16"), ("O1", "bfloat16"), ("O2", "float16"), ("O2", "bfloat16"),
    ("O3", "float16"), ("O3", "bfloat16"), ("O4", "bfloat16"), ("O5", "bfloat16"), ("O5+fused_update", "bfloat16"),
    # FP8 (torchao): the middle layer of the net in FP8 ("all": its shapes are below the
    # thresholds where FP8 pays), the first kept in BF16 as torchao advises
    ("O6+fp8_all", "bfloat16"), ("O7+fp8_all", "bfloat16"),
]
INF_CASES = ["inf-O1-plain", "inf-O2-scale_loss", "nosync-O1", "nosync-O2", "separate-models-O1",
             "inf-O2-fused", "nosync-O2-fused", "separate-models-O2-fused"]
ACCUM_CASES = ["accum-O1", "accum-O2", "accum-O2-scale_loss"]
MICRO = 3
FSDP_CASES = ["fsdp-O1-bfloat16", "fsdp-O1-float16"]
REFUSED = ["fsdp2-O3", "fsdp1-O2"]

# ============================================================ the worker side


def _net(seed=0, norm="batch"):
    # the batch norm: buffers that DDP broadcasts
    return mlp(16, 32, 32, 4, seed=seed, norm=["batch" if norm == "batch" else None, "layer"], act=[nn.ReLU, nn.GELU])


def _batches(rank, n=STEPS, micro=1):
    """The same ``micro`` batches every step (so the loss falls), different on each
    rank (so only the all-reduce makes the ranks agree)."""
    g = torch.Generator().manual_seed(100 + rank)
    batch = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(micro)]
    return [batch] * n


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _raw(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(model, net, opt, rank):
    """STEPS plain steps of ``net`` (``model`` or a wrapper of it). Returns the
    losses, the list that collects ``model[0]``'s output dtypes (it goes on
    collecting), and the last input."""
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = []
    for (x, t), in _batches(rank):
        opt.zero_grad()
        loss = F.mse_loss(net(x).float(), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, seen, x


def _ddp_case(rank, level, half):
    import amp_patch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _net()
    # O3 has no masters: Adam's eps (1e-8) would vanish in the FP16 weights it updates.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if level == "O3" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = _snapshot(model)
    level, _, option = level.partition("+")
    extra = {"fp8_layers": "all"} if option == "fp8_all" else {option: True} if option else {}
    if level in ("O6", "O7"):
        try:
            import torchao  # noqa: F401
        except ImportError:
            return dict(skip="torchao is not installed (pip install -e '.[fp8]')")
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=getattr(torch, half), **extra)
    try:
        ddp = DDP(model)
        losses, seen, x = _train(model, ddp, opt, rank)
        # Each rank's last training forward updated its batchnorm statistics
        # from its own batch; an eval forward takes rank 0's, as DDP does.
        ddp.eval()
        with torch.no_grad():
            ddp(x)
        masters = [p.detach().clone() for p in amp_patch.master_params(opt)]
        fp8 = sorted(r["layer"] for r in amp_patch.report().to_dict()["fp8"] if r["runs_in"] == "float8")
        return dict(state=_snapshot(model), raw=_raw(model), masters=masters, losses=losses, fp8=fp8,
                    start=start, linear_dtype=str(seen[-1]), counters=amp_patch.counters(),
                    one_pass_built=amp_patch.precision.onepass.native is not None,
                    sqrt_mode=amp_patch.precision.onepass.sqrt_mode())
    finally:
        amp_patch.deinitialize()


def _inf_case(rank, name):
    """An inf in rank 1's input at BAD_STEP; record every rank's state after each step."""
    import amp_patch
    from torch.nn.parallel import DistributedDataParallel as DDP

    level = "O2" if "O2" in name else "O1"
    separate = name.startswith("separate")
    micro = 2 if name.startswith("nosync") else 1
    model = _net(seed=rank if separate else 0, norm="layer")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    extra = {"fused_update": True} if name.endswith("-fused") else {}
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=torch.float16, **extra)
    try:
        net = model if separate else DDP(model)
        states, scales, skipped = [_snapshot(model)], [amp_patch.counters()["loss_scale"][0]], []
        for step, batch in enumerate(_batches(rank, micro=micro)):
            opt.zero_grad()
            for k, (x, t) in enumerate(batch):
                if step == BAD_STEP and rank == 1 and k == 0:
                    x = x.clone()
                    x[0, 0] = float("inf")
                last = k == len(batch) - 1
                # no_sync(): the first micro-batch's gradients stay local to each rank
                ctx = net.no_sync() if (micro > 1 and not last) else _nothing()
                with ctx:
                    loss = F.mse_loss(net(x).float(), t)
                    if "scale_loss" in name:
                        with amp_patch.scale_loss(loss, opt) as scaled:
                            scaled.backward()
                    else:
                        loss.backward()
            opt.step()
            states.append(_snapshot(model))
            c = amp_patch.counters()
            scales.append(c["loss_scale"][0])
            skipped.append(c["skipped"])
        return dict(states=states, scales=scales, skipped=skipped, fused=c["optimizers"][0]["fused"],
                    one_pass=c["optimizers"][0]["one_pass"], one_pass_built=amp_patch.precision.onepass.native is not None)
    finally:
        amp_patch.deinitialize()


def _accum_case(rank, name):
    """MICRO micro-batches under ``no_sync()`` but the last, FP16 with a large
    static scale: the gradients after every backward, and the batches, for the
    test to compare with FP32."""
    import amp_patch
    from torch.nn.parallel import DistributedDataParallel as DDP

    level = "O2" if "O2" in name else "O1"
    model = _net(norm="layer")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=torch.float16, loss_scale=1024.0, verbosity=0)
    try:
        ddp = DDP(model)
        (batch,) = _batches(rank, n=1, micro=MICRO)
        after, mirrored = [], []
        opt.zero_grad()
        for k, (x, t) in enumerate(batch):
            ctx = ddp.no_sync() if k < MICRO - 1 else _nothing()
            with ctx:
                loss = F.mse_loss(ddp(x).float(), t)
                if "scale_loss" in name:
                    with amp_patch.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
            after.append([p.grad.detach().clone() for p in amp_patch.master_params(opt)])
            # the model's .grad reads the true running sum too, rounded to its dtype
            mirrored.append(all(torch.equal(p.grad, m.grad.to(p.dtype))
                                for p, m in zip(model.parameters(), amp_patch.master_params(opt))))
        opt.step()
        return dict(after=after, mirrored=mirrored, batch=batch, skipped=amp_patch.counters()["skipped"],
                    masters=[p.detach().clone() for p in amp_patch.master_params(opt)])
    finally:
        amp_patch.deinitialize()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _full(model):
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _fsdp_case(rank, half):
    import amp_patch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(wrap):
        model = _net(norm="layer")
        if wrap == "fsdp":
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = amp_patch.initialize(model, opt, "O1", half_dtype=getattr(torch, half))
        try:
            net = DDP(model) if wrap == "ddp" else model
            losses, seen, _ = _train(model, net, opt, rank)
            return dict(state=_full(model), losses=losses, linear_dtype=str(seen[-1]), counters=amp_patch.counters(),
                        one_pass_built=amp_patch.precision.onepass.native is not None,
                        sqrt_mode=amp_patch.precision.onepass.sqrt_mode())
        finally:
            amp_patch.deinitialize()

    return dict(fsdp=train("fsdp"), ddp=train("ddp"))


def _refused_case(rank, kind):
    import amp_patch

    before = Snapshot()
    model = _net(norm="layer")
    if kind == "fsdp2-O3":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    dtypes = {p.dtype for p in model.parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        amp_patch.initialize(model, opt, kind.rsplit("-", 1)[1], half_dtype=torch.bfloat16)
    except Exception as e:
        error = (type(e).__name__, str(e))
    else:
        amp_patch.deinitialize()
        error = None
    changed = before.changed()
    return dict(error=error, changed=changed, initialized=amp_patch.is_initialized(),
                dtypes_before=sorted(map(str, dtypes)), dtypes_after=sorted({str(p.dtype) for p in model.parameters()}))


def _worker(rank, port, out_dir):
    cases = [(f"ddp-{lvl}-{half}", lambda lvl=lvl, half=half: _ddp_case(rank, lvl, half)) for lvl, half in DDP_CASES]
    cases += [(name, lambda name=name: _inf_case(rank, name)) for name in INF_CASES]
    cases += [(name, lambda name=name: _accum_case(rank, name)) for name in ACCUM_CASES]
    cases += [(name, lambda name=name: _fsdp_case(rank, name.rsplit("-", 1)[1])) for name in FSDP_CASES]
    cases += [(name, lambda name=name: _refused_case(rank, name)) for name in REFUSED]
    serve_cases(rank, port, out_dir, WORLD, cases, timeout=120)


# ============================================================ the test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the workers once; return ``[rank0_results, rank1_results]``."""
    return run_workers(__file__, WORLD, tmp_path_factory.mktemp("dist"), timeout=480, PYTHONWARNINGS="ignore")


def _assert_identical(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_identical(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what} differs between the ranks"
    else:
        assert a == b, what


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("level,half", DDP_CASES)
def test_ddp_ranks_stay_bitwise_identical(ranks, level, half):
    r0, r1 = case_results(ranks, f"ddp-{level}-{half}")
    if "skip" in r0:
        pytest.skip(r0["skip"])
    for key in ("state", "raw", "masters", "fp8"):
        _assert_identical(r0[key], r1[key], key)
    # Different data on each rank (different losses), yet one model.
    assert r0["losses"] != r1["losses"]
    assert all(torch.isfinite(v).all() for v in r0["state"].values() if v.is_floating_point())
    changed = [k for k, v in r0["state"].items() if v.is_floating_point() and not torch.equal(v.float(), r0["start"][k].float())]
    assert "0.weight" in changed and "6.weight" in changed
    # Low-precision compute, and an FP32 checkpoint (from the masters where they exist).
    assert r0["linear_dtype"] == f"torch.{half}"
    assert r0["state"]["0.weight"].dtype == torch.float32
    assert r0["raw"][0].dtype == (torch.float32 if level in ("O1", "O4") else getattr(torch, half))
    if level[:2] in ("O6", "O7"):
        assert r0["fp8"] == ["3"], "the middle Linear computes in FP8 on every rank"
    assert all(m.dtype == torch.float32 for m in r0["masters"]) == (level != "O3")
    assert r0["counters"]["skipped"] == r1["counters"]["skipped"]
    # O1/O2/O4/O5: the one-pass C step, where it is built, takes every step (fused_update or
    # not; O1/O4's AdamW where its square root is torch's); O3 (half parameters) never;
    # without it the compiled update takes every step after the first (which creates AdamW's state)
    c = r0["counters"]["optimizers"][0]
    if r0["one_pass_built"]:
        # O7's moments are decoded around torch's own step (precision.lowstate): no one-pass step
        one_pass = 0 if level == "O3" or level.startswith("O7") or (level in ("O1", "O4") and r0["sqrt_mode"] == "approximate") else STEPS
        assert (c["one_pass"], c["fused"]) == (one_pass, 0)
    else:
        assert c["fused"] == (STEPS - 1 if "fused_update" in level else 0)


@pytest.mark.parametrize("name", INF_CASES)
def test_inf_on_one_rank_skips_the_same_step_everywhere(ranks, name):
    r0, r1 = case_results(ranks, name)
    for r in (r0, r1):
        states, scales = r["states"], r["scales"]
        # Exactly the bad step was skipped: its weights are the step before's.
        assert r["skipped"][BAD_STEP:] == [1] * (STEPS - BAD_STEP)
        assert r["skipped"][:BAD_STEP] == [0] * BAD_STEP
        for k in states[0]:
            assert torch.equal(states[BAD_STEP + 1][k], states[BAD_STEP][k]), k
        for s in (1, BAD_STEP, STEPS):
            assert not torch.equal(states[s]["0.weight"], states[s - 1]["0.weight"]), s
        assert scales[BAD_STEP + 1] == scales[BAD_STEP] / 2
        assert all(torch.isfinite(v).all() for v in states[-1].values())
        # O1 and O2: the one-pass C step, where it is built, takes every step but the skipped
        # one; without it the compiled update (-fused) every step but the first and the skipped one
        if r["one_pass_built"]:
            assert (r["one_pass"], r["fused"]) == (STEPS - 1, 0)
        else:
            assert r["fused"] == (STEPS - 2 if name.endswith("-fused") else 0)
    _assert_identical(r0["scales"], r1["scales"], "loss scale")
    if name.startswith("separate"):
        assert not torch.equal(r0["states"][0]["0.weight"], r1["states"][0]["0.weight"])
    else:
        _assert_identical(r0["states"], r1["states"], "weights")


@pytest.mark.parametrize("name", ACCUM_CASES)
def test_no_sync_accumulation_gives_true_gradients_and_the_all_reduce_sees_the_whole_sum(ranks, name):
    """After every micro-batch the gradients user code reads are true (the
    local running sum, under ``no_sync()``); after the last one they are the
    all-reduced mean of both ranks' whole sums, as in FP32."""
    results = case_results(ranks, name)
    local = []
    for r in results:
        ref = _net(norm="layer")
        sums = []
        for x, t in r["batch"]:
            F.mse_loss(ref(x), t).backward()
            sums.append([p.grad.clone() for p in ref.parameters()])
        local.append(sums)
    tol = dict(rtol=2e-2, atol=2e-3)
    for rank, r in enumerate(results):
        assert r["skipped"] == 0
        assert all(r["mirrored"]), "the model's .grad did not read the masters' true sum after every backward"
        for k in range(MICRO - 1):
            for g, want in zip(r["after"][k], local[rank][k]):
                torch.testing.assert_close(g, want, **tol)
        mean = [(a + b) / WORLD for a, b in zip(local[0][-1], local[1][-1])]
        for g, want in zip(r["after"][-1], mean):
            torch.testing.assert_close(g, want, **tol)
    _assert_identical(results[0]["masters"], results[1]["masters"], "masters")


@pytest.mark.parametrize("name", FSDP_CASES)
def test_fsdp_fully_shard_under_o1_matches_ddp(ranks, name):
    half = name.rsplit("-", 1)[1]
    r0, r1 = case_results(ranks, name)
    _assert_identical(r0["fsdp"]["state"], r1["fsdp"]["state"], "full state")
    for r in (r0, r1):
        fsdp, ddp = r["fsdp"], r["ddp"]
        assert fsdp["linear_dtype"] == f"torch.{half}"
        assert fsdp["losses"][-1] < fsdp["losses"][0]
        assert fsdp["counters"]["skipped"] == ddp["counters"]["skipped"]
        for k, v in fsdp["state"].items():
            assert v.dtype == torch.float32, k
            torch.testing.assert_close(v, ddp["state"][k], rtol=1e-4, atol=1e-5)
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-3)
        # the one-pass step, where it is built and exact for AdamW, takes every step: on
        # fully_shard's DTensors it steps each rank's local shards
        exact = ddp["one_pass_built"] and ddp["sqrt_mode"] != "approximate"
        for r in (fsdp, ddp):
            assert r["counters"]["optimizers"][0]["one_pass"] == (STEPS - r["counters"]["skipped"] if exact else 0)


@pytest.mark.parametrize("kind", REFUSED)
def test_o3_on_fsdp2_and_o2_on_fsdp1_are_refused_with_a_clear_error(ranks, kind):
    for r in case_results(ranks, kind):
        assert r["error"] is not None, f"initialize accepted {kind}"
        cls, msg = r["error"]
        assert cls == "ConfigError"
        assert "FSDP" in msg and "opt_level='O1'" in msg and "MixedPrecision" in msg
        assert ("fully_shard" if kind == "fsdp2-O3" else "FullyShardedDataParallel") in msg
        assert r["changed"] == [] and not r["initialized"]
        assert r["dtypes_after"] == r["dtypes_before"] == ["torch.float32"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
