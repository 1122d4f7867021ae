"""The ``apex.parallel`` stand-in: DistributedDataParallel, Reducer,
SyncBatchNorm, convert_syncbn_model, LARC and the multiproc message.

The distributed scenarios run once in two gloo worker processes on CPU (this
file run as a script); each saves what it saw and the tests compare that
with references computed in one process: the gradient average (or sum) of
the two ranks' batches, and a BatchNorm over the two batches concatenated.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
import amp_patch.apex.parallel as parallel
from amp_patch import amp
from amp_patch.apex.parallel import DistributedDataParallel, Reducer, SyncBatchNorm, convert_syncbn_model
from amp_patch.apex.parallel.LARC import LARC
from amp_patch.apex.parallel.multiproc import main as multiproc_main
from amp_patch.diagnostics.notices import AmpWarning
from helpers import batch, case_results, mlp, run_workers, serve_cases, sgd

WORLD = 2
STEPS = 3
FACTOR = 4.0  # the gradient pre-division factor under test
GRAD_CASES = {
    "average": {},
    "sum": {"gradient_average": False},
    "predivide": {"gradient_predivide_factor": FACTOR},
    "predivide-sum": {"gradient_average": False, "gradient_predivide_factor": FACTOR},
}
IGNORED_GIVEN = dict(message_size=1000, delay_allreduce=True, num_allreduce_streams=2, prof=True)

# ============================================================ shared by both sides


def _mlp(seed=0, dtype=torch.float32):
    return mlp(6, 8, 3, seed=seed, dtype=dtype)


def _bn_net():
    return mlp(6, 8, 3, norm="batch")


def _batch(rank, dtype=torch.float32):
    """Rank ``rank``'s batch: different on each rank, and known to every rank."""
    x, y = batch(rank, 6, 3, rows=4)
    return x.to(dtype), y.to(dtype)


def _grads(model, rank, dtype=torch.float32):
    model.zero_grad(set_to_none=True)
    x, y = _batch(rank, dtype)
    F.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _bn_inputs(rank, layout):
    """Rank ``rank``'s input for a SyncBatchNorm of 4 channels (rank 1's batch is
    larger, so the counts differ), and the weights that make a loss of its output."""
    g = torch.Generator().manual_seed(200 + rank)
    n = 3 + 2 * rank
    shape = {"2d": (n, 4), "4d": (n, 4, 3, 5)}[layout]
    return torch.randn(shape, generator=g) * 3 + 1, torch.randn(shape, generator=g)


def _affine(bn):
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, bn.num_features))
        bn.bias.copy_(torch.linspace(-1.0, 1.0, bn.num_features))
    return bn

# ============================================================ the worker side


def _grad_cases(rank):
    out = {}
    for name, kwargs in GRAD_CASES.items():
        net = _mlp()
        ddp = DistributedDataParallel(net, **kwargs)
        out[name] = _grads(ddp, rank)
    # disable_allreduce keeps gradients local; enable_allreduce averages again
    net = _mlp()
    ddp = DistributedDataParallel(net)
    ddp.disable_allreduce()
    out["disabled"] = _grads(ddp, rank)
    ddp.enable_allreduce()
    out["enabled"] = _grads(ddp, rank)
    out["module_is_net"] = ddp.module is net
    out["is_torch_ddp"] = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    return out


def _fp32_cases(rank):
    # the local gradients too: exact comparisons need this process's thread settings
    out = {"local": [_grads(_mlp(dtype=torch.bfloat16), r, torch.bfloat16) for r in range(WORLD)]}
    for fp32 in (True, False):
        ddp = DistributedDataParallel(_mlp(dtype=torch.bfloat16), allreduce_always_fp32=fp32,
                                      gradient_predivide_factor=3.0)
        out[fp32] = _grads(ddp, rank, torch.bfloat16)
    return out


def _train(model, rank):
    ddp = DistributedDataParallel(model)
    opt = sgd(model, momentum=0.9)
    losses = []
    x, y = _batch(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # torch's DDP would now broadcast rank 0's buffers; Apex's never did
    ddp.eval()
    with torch.no_grad():
        ddp(x)
    return dict(state={k: v.detach().clone() for k, v in model.state_dict().items()}, losses=losses)


def _warning_cases(rank):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DistributedDataParallel(_mlp())
        plain = [str(w.message) for w in seen]
        del seen[:]
        DistributedDataParallel(_mlp(), allreduce_trigger_params=list(_mlp().parameters())[:1],
                                gradient_predivide_factor=2.0, allreduce_always_fp32=True, **IGNORED_GIVEN)
    return dict(plain=plain, given=[(w.category.__name__, str(w.message), os.path.basename(w.filename)) for w in seen])


def _syncbn_cases(rank):
    out = {}
    for layout in ("2d", "4d"):
        for channel_last in (False, True):
            if layout == "2d" and channel_last:
                continue
            x, w = _bn_inputs(rank, layout)
            if channel_last:
                x, w = x.movedim(1, -1).contiguous(), w.movedim(1, -1).contiguous()
            x.requires_grad_(True)
            bn = _affine(SyncBatchNorm(4, momentum=0.3, channel_last=channel_last))
            y = bn(x)
            (y * w).sum().backward()
            bn.eval()
            with torch.no_grad():
                y_eval = bn(x)
            out[f"{layout}-{channel_last}"] = dict(
                y=y.detach(), x_grad=x.grad, w_grad=bn.weight.grad, b_grad=bn.bias.grad, y_eval=y_eval,
                running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
                tracked=int(bn.num_batches_tracked))
    x, _ = _bn_inputs(rank, "4d")
    z = torch.randn_like(x)
    with torch.no_grad():
        out["fuse_relu"] = dict(y=_affine(SyncBatchNorm(4, fuse_relu=True))(x, z), z=z)
        out["bf16"] = _affine(SyncBatchNorm(4))(x.bfloat16())
        local = parallel.create_syncbn_process_group(1)
        out["group_of_one"] = _affine(SyncBatchNorm(4, process_group=local))(x)
    out["group_of_world"] = parallel.create_syncbn_process_group(0)
    return out


def _reducer_cases(rank):
    net = _mlp(seed=rank)  # different on each rank until the Reducer broadcasts rank 0's
    reducer = Reducer(net)
    params = [p.detach().clone() for p in net.parameters()]
    _grads(net, rank)
    reducer.reduce()
    tensors = [torch.full((3,), rank + 1.0), torch.full((2,), 10.0 * rank, dtype=torch.float64)]
    Reducer(tensors).reduce()
    return dict(params=params, grads=[p.grad for p in net.parameters()], tensors=tensors)


def _worker(rank, port, out_dir):
    cases = {
        "grads": lambda: _grad_cases(rank),
        "fp32": lambda: _fp32_cases(rank),
        "train": lambda: _train(_bn_net(), rank),
        "train-syncbn": lambda: _train(convert_syncbn_model(_bn_net()), rank),
        "warnings": lambda: _warning_cases(rank),
        "syncbn": lambda: _syncbn_cases(rank),
        "reducer": lambda: _reducer_cases(rank),
    }
    serve_cases(rank, port, out_dir, WORLD, cases.items(), timeout=60)


# ============================================================ the test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run the workers once; return ``[rank0_results, rank1_results]``."""
    return run_workers(__file__, WORLD, tmp_path_factory.mktemp("apex_parallel"), timeout=240)


def _local_grads(dtype=torch.float32):
    """Each rank's gradients on its own batch, from one process."""
    return [_grads(_mlp(dtype=dtype), r, dtype) for r in range(WORLD)]


def _equal(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_ddp_gradients_are_the_average_or_sum_of_the_ranks(ranks, name):
    g0, g1 = _local_grads()
    expected = {
        "average": [(a + b) / 2 for a, b in zip(g0, g1)],
        "sum": [a + b for a, b in zip(g0, g1)],
        "predivide": [(a / FACTOR + b / FACTOR) * (FACTOR / 2) for a, b in zip(g0, g1)],
        "predivide-sum": [a / FACTOR + b / FACTOR for a, b in zip(g0, g1)],
    }[name]
    r0, r1 = case_results(ranks, "grads")
    assert _equal(r0[name], r1[name]), "the ranks' gradients differ"
    for got, want in zip(r0[name], expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(r0[name][0], g0[0]), "gradients stayed local"


@pytest.mark.slow
def test_ddp_is_torch_ddp_and_disable_allreduce_keeps_gradients_local(ranks):
    local = _local_grads()
    average = [(a + b) / 2 for a, b in zip(*local)]
    for rank, r in enumerate(case_results(ranks, "grads")):
        assert r["module_is_net"] and r["is_torch_ddp"]
        assert _equal(r["disabled"], local[rank])
        for got, want in zip(r["enabled"], average):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_allreduce_always_fp32_reduces_bf16_gradients_in_fp32(ranks):
    r0, r1 = case_results(ranks, "fp32")
    g0, g1 = r0["local"]
    # Apex's arithmetic, carried out in FP32 and rounded to BF16 once at the end
    want = [(a.float().mul(1 / 3.0) + b.float().mul(1 / 3.0)).mul(3.0 / 2).bfloat16() for a, b in zip(g0, g1)]
    for r in (r0, r1):
        assert all(g.dtype == torch.bfloat16 for g in r[True])
        assert _equal(r[True], want)
    # reduced in BF16 instead, the rounding differs somewhere
    assert _equal(r0[False], r1[False]) and not _equal(r0[False], want)


@pytest.mark.slow
def test_ddp_ranks_end_identical_and_keep_their_own_buffers(ranks):
    r0, r1 = case_results(ranks, "train")
    assert r0["losses"] != r1["losses"]
    for k, v in r0["state"].items():
        if "running" in k:
            # as in Apex, batch-norm statistics are not broadcast
            assert not torch.equal(v, r1["state"][k]), k
        else:
            assert torch.equal(v, r1["state"][k]), k
    assert not torch.equal(r0["state"]["0.weight"], _bn_net().state_dict()["0.weight"])


@pytest.mark.slow
def test_syncbn_ddp_training_equals_one_process_on_the_whole_batch(ranks):
    r0, r1 = case_results(ranks, "train-syncbn")
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k
    # one process, plain BatchNorm, both ranks' batches at once (equal sizes: the mean loss is DDP's average)
    model = _bn_net()
    opt = sgd(model, momentum=0.9)
    x, y = (torch.cat(t) for t in zip(*(_batch(r) for r in range(WORLD))))
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_ignored_apex_arguments_give_one_warning_naming_them(ranks):
    for r in case_results(ranks, "warnings"):
        assert r["plain"] == []
        assert len(r["given"]) == 1, r["given"]
        category, message, filename = r["given"][0]
        assert category == AmpWarning.__name__
        assert filename == os.path.basename(__file__)  # it points at the caller's line
        for name in list(IGNORED_GIVEN) + ["allreduce_trigger_params"]:
            assert name in message
        for honoured in ("gradient_predivide_factor", "allreduce_always_fp32", "retain_allreduce_buffers"):
            assert honoured not in message
        assert "torch.nn.parallel.DistributedDataParallel" in message


def test_shared_param_is_refused_as_in_apex():
    with pytest.raises(ValueError, match="shared_param"):
        DistributedDataParallel(_mlp(), shared_param=True)


def _bn_reference(layout):
    """BatchNorm over both ranks' inputs at once: per rank, its output slice,
    input gradient slice and eval output, and the whole batch's statistics."""
    xs, ws = zip(*(_bn_inputs(r, layout) for r in range(WORLD)))
    x = torch.cat(xs).requires_grad_(True)
    bn = _affine((nn.BatchNorm1d if layout == "2d" else nn.BatchNorm2d)(4, momentum=0.3))
    y = bn(x)
    (y * torch.cat(ws)).sum().backward()
    bn.eval()
    with torch.no_grad():
        y_eval = bn(x)
    sizes = [len(t) for t in xs]
    return dict(y=y.detach().split(sizes), x_grad=x.grad.split(sizes), y_eval=y_eval.split(sizes),
                w_grad=bn.weight.grad, b_grad=bn.bias.grad, running_mean=bn.running_mean,
                running_var=bn.running_var)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2d-False", "4d-False", "4d-True"])
def test_syncbn_under_gloo_equals_batchnorm_over_the_concatenated_batch(ranks, case):
    layout, channel_last = case.split("-")
    ref = _bn_reference(layout)
    got = [r[case] for r in case_results(ranks, "syncbn")]
    close = dict(rtol=1e-5, atol=1e-5)
    for rank, r in enumerate(got):
        back = (lambda t: t.movedim(-1, 1)) if channel_last == "True" else (lambda t: t)
        torch.testing.assert_close(back(r["y"]), ref["y"][rank], **close)
        torch.testing.assert_close(back(r["x_grad"]), ref["x_grad"][rank], **close)
        torch.testing.assert_close(back(r["y_eval"]), ref["y_eval"][rank], **close)
        torch.testing.assert_close(r["running_mean"], ref["running_mean"], **close)
        torch.testing.assert_close(r["running_var"], ref["running_var"], **close)
        assert r["tracked"] == 1
    # each rank's parameter gradient covers its own part; DDP would sum (and average) them
    torch.testing.assert_close(got[0]["w_grad"] + got[1]["w_grad"], ref["w_grad"], **close)
    torch.testing.assert_close(got[0]["b_grad"] + got[1]["b_grad"], ref["b_grad"], **close)


@pytest.mark.slow
def test_syncbn_fuse_relu_bf16_and_process_groups(ranks):
    x = torch.cat([_bn_inputs(r, "4d")[0] for r in range(WORLD)])
    whole = _affine(nn.BatchNorm2d(4))(x).detach().split([3, 5])
    for rank, r in enumerate(case_results(ranks, "syncbn")):
        torch.testing.assert_close(r["fuse_relu"]["y"], F.relu(whole[rank] + r["fuse_relu"]["z"]), rtol=1e-5, atol=1e-5)
        assert r["bf16"].dtype == torch.bfloat16
        torch.testing.assert_close(r["bf16"].float(), whole[rank], rtol=2e-2, atol=5e-2)
        # a group of one process normalises with that process's batch alone
        alone = _affine(nn.BatchNorm2d(4))(_bn_inputs(rank, "4d")[0]).detach()
        torch.testing.assert_close(r["group_of_one"], alone, rtol=1e-5, atol=1e-5)
        assert r["group_of_world"] is None


@pytest.mark.slow
def test_reducer_broadcasts_rank0_and_averages_on_reduce(ranks):
    local = _local_grads()
    for r in case_results(ranks, "reducer"):
        assert _equal(r["params"], [p.detach() for p in _mlp(seed=0).parameters()])
        for got, want in zip(r["grads"], [(a + b) / 2 for a, b in zip(*local)]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert torch.equal(r["tensors"][0], torch.full((3,), 1.5))
        assert torch.equal(r["tensors"][1], torch.full((2,), 5.0, dtype=torch.float64))


@pytest.mark.quick
def test_syncbn_without_a_process_group_is_plain_batchnorm():
    for momentum in (0.1, None):
        x = torch.randn(5, 4, 3, 3) * 2 + 1
        bn, sbn = _affine(nn.BatchNorm2d(4, momentum=momentum)), _affine(SyncBatchNorm(4, momentum=momentum))
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        for _ in range(2):
            ya, yb = bn(xa), sbn(xb)
        assert torch.equal(ya, yb)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad) and torch.equal(bn.weight.grad, sbn.weight.grad)
        for k, v in bn.state_dict().items():
            assert torch.equal(v, sbn.state_dict()[k]), k
        bn.eval()
        sbn.eval()
        assert torch.equal(bn(x), sbn(x))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        SyncBatchNorm(4)(torch.randn(4))


@pytest.mark.quick
def test_convert_syncbn_model_swaps_batchnorms_and_keeps_their_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.2, eps=1e-3), nn.ReLU(),
                          nn.Sequential(nn.InstanceNorm2d(4, affine=True), nn.BatchNorm2d(4, affine=False)))
    x = torch.randn(2, 3, 6, 6)
    model(x)  # running statistics that differ from the initial ones
    with torch.no_grad():
        model[1].weight.mul_(3)
    model.eval()
    before = model(x)
    old = list(model.modules())
    group = object()
    converted = convert_syncbn_model(model, process_group=group)
    assert converted is model
    assert [type(m).__name__ for m in converted.modules()] == [
        "Sequential", "Conv2d", "SyncBatchNorm", "ReLU", "Sequential", "InstanceNorm2d", "SyncBatchNorm"]
    bn = converted[1]
    # the same tensors, so an optimizer built before the conversion still works
    assert bn.weight is old[2].weight and bn.running_mean is old[2].running_mean
    assert (bn.eps, bn.momentum, bn.process_group, bn.training) == (1e-3, 0.2, group, False)
    assert converted[3][0] is old[5]
    assert converted[3][1].weight is None and torch.equal(converted[3][1].running_var, old[6].running_var)
    assert int(converted[3][1].num_batches_tracked) == 1
    assert torch.equal(converted(x), before)
    lone = convert_syncbn_model(nn.BatchNorm1d(3), channel_last=True)
    assert isinstance(lone, SyncBatchNorm) and lone.channel_last and lone.training


def _larc_reference(params, grads, groups, trust, clip, eps, steps_state):
    """One LARC step followed by SGD with momentum 0.9, by hand, from plain Python numbers."""
    new = []
    for p, g, (lr, wd), buf in zip(params, grads, groups, steps_state):
        pn, gn = p.norm().item(), g.norm().item()
        if pn != 0 and gn != 0:
            local = trust * pn / (gn + pn * wd + eps)
            scale = min(local / lr, 1.0) if clip else local
            g = (g + wd * p) * scale
        buf = g.clone() if buf is None else buf * 0.9 + g
        new.append((p - lr * buf, buf))
    return new


@pytest.mark.parametrize("clip", [True, False])
def test_larc_matches_a_hand_computed_step(clip):
    torch.manual_seed(1)
    a, b, zero, frozen = (nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7) * 0.01),
                          nn.Parameter(torch.zeros(4)), nn.Parameter(torch.randn(2)))
    inner = torch.optim.SGD([{"params": [a, zero, frozen], "weight_decay": 1e-2},
                             {"params": [b], "lr": 0.5}], lr=0.1, momentum=0.9)
    opt = LARC(inner, trust_coefficient=0.02, clip=clip, eps=1e-8)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    groups = [(0.1, 1e-2), (0.1, 1e-2), (0.5, 0.0)]
    params, bufs = [a, zero, b], [None, None, None]
    for _ in range(2):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        want = _larc_reference([p.detach().clone() for p in params], grads, groups, 0.02, clip, 1e-8, bufs)
        opt.step()
        for p, (w, buf) in zip(params, want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)
        bufs = [buf for _, buf in want]
        assert [g["weight_decay"] for g in inner.param_groups] == [1e-2, 0], "weight decay not restored"
        assert frozen.grad is None
    assert opt.state_dict() == inner.state_dict()
    opt.zero_grad()
    assert a.grad is None


@pytest.mark.quick
def test_larc_passes_state_and_param_groups_through():
    net = _mlp()
    opt = LARC(sgd(net, momentum=0.9))
    _grads(net, 0)
    opt.step()
    fresh = LARC(sgd(_mlp(), momentum=0.9))
    fresh.load_state_dict(opt.state_dict())
    assert all(torch.equal(fresh.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
               for p, q in zip(fresh.optim.param_groups[0]["params"], opt.optim.param_groups[0]["params"]))
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 0.01})
    assert opt.optim.param_groups[-1]["params"] == [extra] and len(opt.param_groups) == 2
    opt.param_groups = opt.param_groups[:1]
    assert len(opt.optim.param_groups) == 1
    assert "LARC(trust_coefficient=0.02, clip=True" in repr(opt) and "SGD" in repr(opt)


@pytest.mark.quick
def test_apex_parallel_names_and_layout():
    # `from apex.parallel import LARC` gives the module, as Apex's did; the class is LARC.LARC
    assert parallel.LARC.__name__ == "amp_patch.apex.parallel.LARC" and parallel.LARC.LARC is LARC
    assert parallel.ReduceOp is torch.distributed.ReduceOp
    for name in parallel.__all__:
        assert getattr(parallel, name) is not None, name


def test_multiproc_points_to_torchrun(capsys):
    assert multiproc_main(["main.py", "--world-size", "4", "-b", "64", "--rank", "0"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node=4 main.py -b 64\n" in err
    assert "RANK" in err and "WORLD_SIZE" in err


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_larc_under_amp_initialize_rescales_true_gradients(level):
    """SwAV's pattern: amp.initialize(model, LARC(opt)). LARC reads the gradients
    to rescale them, so it must see them unscaled (and, under O2, in the masters)."""
    def train(loss_scale, wrap=True):
        model = mlp(8, 16, 2)
        inner = sgd(model, momentum=0.9, weight_decay=1e-4)
        opt = LARC(inner, trust_coefficient=0.001, clip=False) if wrap else inner
        model, given = amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16, loss_scale=loss_scale,
                                      verbosity=0)
        assert given is opt  # handed back as given
        try:
            for i in range(3):
                x, y = batch(i, 8, 2, rows=16)
                opt.zero_grad()
                with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                opt.step()
        finally:
            amp_patch.deinitialize()
        return [p.detach() for p in model.parameters()]

    scaled, unscaled, plain = train(1024.0), train(1.0), train(1.0, wrap=False)
    assert all(torch.equal(a, b) for a, b in zip(scaled, unscaled))  # the loss scale changes nothing
    assert not all(torch.equal(a, b) for a, b in zip(unscaled, plain))  # and LARC did rescale
