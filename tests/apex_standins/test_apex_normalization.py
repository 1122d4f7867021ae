"""The apex.normalization stand-in against what Apex's fused norms compute:
torch's layer norm / RMS norm in FP32, and Apex's dtype contract for half
inputs (Fused*: the input's dtype; Mixed*: the weight's; autocast: its dtype)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_patch.apex.normalization import fused_layer_norm as N
from helpers import amp

HALF = [torch.float16, torch.bfloat16]


def x_(shape=(4, 6, 8), dtype=torch.float32, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1).to(dtype)


def randomize(module, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def rms_reference(x, shape, weight, eps):
    """RMS norm (Zhang & Sennrich 2019) in FP64: x / sqrt(mean(x**2) + eps) * weight."""
    dims = tuple(range(-len(shape), 0))
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


# ------------------------------------------------------------------ FP32: the same as torch


@pytest.mark.parametrize("shape", [8, [8], (6, 8)])
def test_fused_layer_norm_is_nn_layer_norm(shape):
    fused = randomize(N.FusedLayerNorm(shape))
    ref = nn.LayerNorm(shape)
    ref.load_state_dict(fused.state_dict())
    x = x_().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    y, yr = fused(x), ref(xr)
    assert torch.equal(y, yr)
    y.pow(2).sum().backward()
    yr.pow(2).sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(fused.weight.grad, ref.weight.grad)
    assert torch.equal(fused.bias.grad, ref.bias.grad)


@pytest.mark.quick
def test_fused_rms_norm_is_rms_norm():
    norm = randomize(N.FusedRMSNorm((6, 8)))
    x = x_()
    y = norm(x)
    assert torch.equal(y, F.rms_norm(x, (6, 8), norm.weight, 1e-5))
    torch.testing.assert_close(y.double(), rms_reference(x, (6, 8), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)
    bare = N.FusedRMSNorm(8, eps=1e-3, elementwise_affine=False)
    torch.testing.assert_close(bare(x).double(), rms_reference(x, (8,), None, 1e-3), rtol=1e-5, atol=1e-6)


def test_apex_constructor_arguments_and_defaults():
    ln = N.FusedLayerNorm(8, memory_efficient=True)
    assert ln.eps == 1e-5 and ln.memory_efficient and ln.normalized_shape == (8,)
    assert torch.equal(ln.weight, torch.ones(8)) and torch.equal(ln.bias, torch.zeros(8))
    plain = N.FusedLayerNorm([6, 8], eps=1e-6, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and list(plain.parameters()) == []
    assert plain.eps == 1e-6 and plain.elementwise_affine is False
    rms = N.FusedRMSNorm(8)
    assert rms.eps == 1e-5 and torch.equal(rms.weight, torch.ones(8)) and not rms.memory_efficient
    assert N.FusedRMSNorm(8, elementwise_affine=False).weight is None


def test_they_are_torch_norms():
    for cls in (N.FusedLayerNorm, N.MixedFusedLayerNorm):
        assert isinstance(cls(4), nn.LayerNorm)
    for cls in (N.FusedRMSNorm, N.MixedFusedRMSNorm):
        assert isinstance(cls(4), nn.RMSNorm)
    assert isinstance(N.MixedFusedLayerNorm(4), N.FusedLayerNorm)


def test_mixed_norms_are_always_affine_as_apex():
    for cls in (N.MixedFusedLayerNorm, N.MixedFusedRMSNorm):
        with pytest.warns(UserWarning, match="does not support `elementwise_affine` argument"):
            m = cls(8, elementwise_affine=True)
        assert m.weight is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="does not support `elementwise_affine = False`"):
                cls(8, elementwise_affine=False)
        assert cls(8, 1e-6, memory_efficient=True).memory_efficient


# ------------------------------------------------------------------ the dtype contract


@pytest.mark.parametrize("dtype", HALF)
def test_fused_norms_keep_the_input_dtype_with_fp32_weights(dtype):
    ln, rms = randomize(N.FusedLayerNorm(8)), randomize(N.FusedRMSNorm(8))
    x = x_(dtype=dtype)
    y = ln(x)
    # Apex's kernel: FP32 statistics and affine step, one rounding into the input dtype
    assert y.dtype == dtype and torch.equal(y, F.layer_norm(x.float(), (8,), ln.weight, ln.bias, 1e-5).to(dtype))
    z = rms(x)
    assert z.dtype == dtype and torch.equal(z, F.rms_norm(x.float(), (8,), rms.weight, 1e-5).to(dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_norms_return_the_weight_dtype(dtype):
    ln, rms = randomize(N.MixedFusedLayerNorm(8)), randomize(N.MixedFusedRMSNorm(8))
    x = x_(dtype=dtype)
    y, z = ln(x), rms(x)
    assert y.dtype == torch.float32 and torch.equal(y, F.layer_norm(x.float(), (8,), ln.weight, ln.bias, 1e-5))
    assert z.dtype == torch.float32 and torch.equal(z, F.rms_norm(x.float(), (8,), rms.weight, 1e-5))
    # half weights: half out, whatever the input
    ln.to(dtype)
    assert ln(x).dtype == dtype and ln(x.float()).dtype == dtype


@pytest.mark.parametrize("dtype", HALF)
def test_half_norms_round_once(dtype):
    ln = randomize(N.FusedLayerNorm(8)).to(dtype)
    x = x_(dtype=dtype)
    y = ln(x)
    ref = F.layer_norm(x.double(), (8,), ln.weight.double(), ln.bias.double(), 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", HALF)
def test_backward_with_fp32_weights_and_half_input(dtype):
    ln = randomize(N.FusedLayerNorm(8))
    x = x_(dtype=dtype).requires_grad_()
    ln(x).float().pow(2).sum().backward()
    assert x.grad.dtype == dtype and ln.weight.grad.dtype == torch.float32
    xr = x.detach().float().requires_grad_()
    w, b = ln.weight.detach().clone().requires_grad_(), ln.bias.detach().clone().requires_grad_()
    F.layer_norm(xr, (8,), w, b, 1e-5).to(dtype).float().pow(2).sum().backward()
    assert torch.equal(ln.weight.grad, w.grad) and torch.equal(x.grad, xr.grad.to(dtype))


def test_under_autocast_everything_is_in_the_autocast_dtype():
    x = x_()
    for cls in (N.FusedLayerNorm, N.MixedFusedLayerNorm, N.FusedRMSNorm, N.MixedFusedRMSNorm):
        m = randomize(cls(8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        bf = [t.bfloat16() for t in (x, *m.parameters())]
        want = F.layer_norm(bf[0], (8,), bf[1], bf[2], 1e-5) if len(bf) == 3 else F.rms_norm(bf[0], (8,), bf[1], 1e-5)
        assert y.dtype == torch.bfloat16 and torch.equal(y, want), cls.__name__


# ------------------------------------------------------------------ the functional forms


@pytest.mark.quick
def test_functional_forms():
    ln = randomize(N.FusedLayerNorm(8))
    w, b = ln.weight.detach(), ln.bias.detach()
    x = x_()
    # Apex's functions default to eps=1e-6 (its modules to 1e-5)
    assert torch.equal(N.fused_layer_norm_affine(x, w, b, (8,)), F.layer_norm(x, (8,), w, b, 1e-6))
    assert torch.equal(N.fused_layer_norm(x, 8, 1e-5), F.layer_norm(x, (8,), None, None, 1e-5))
    assert torch.equal(N.fused_rms_norm_affine(x, w, [8]), F.rms_norm(x, (8,), w, 1e-6))
    assert torch.equal(N.fused_rms_norm(x, (6, 8)), F.rms_norm(x, (6, 8), None, 1e-6))
    h = x.half()
    assert N.fused_layer_norm_affine(h, w, b, (8,)).dtype == torch.float16
    assert N.mixed_dtype_fused_layer_norm_affine(h, w, b, (8,)).dtype == torch.float32
    assert N.fused_rms_norm_affine(h, w, (8,)).dtype == torch.float16
    assert N.mixed_dtype_fused_rms_norm_affine(h, w, (8,)).dtype == torch.float32
    assert N.fused_rms_norm(h, (8,)).dtype == torch.float16


# ------------------------------------------------------------------ with amp_patch


def o5_losses(norm, steps=6, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    losses = []
    with amp(model, opt, opt_level="O5", **kwargs) as (model, opt):
        for _ in range(steps):
            loss = (model(x).float() - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        dtype = model[1].weight.dtype
    return losses, dtype


@pytest.mark.parametrize("norm", [N.FusedLayerNorm, N.FusedRMSNorm, N.MixedFusedLayerNorm, N.MixedFusedRMSNorm])
def test_o5_converts_and_trains_the_norms(norm):
    losses, dtype = o5_losses(norm)
    assert dtype == torch.bfloat16 and losses[-1] < losses[0]


@pytest.mark.parametrize("cls", ["FusedLayerNorm", "MixedFusedLayerNorm"])
def test_o5_keeps_a_fused_layer_norm_fp32_as_it_keeps_nn_layer_norm(cls):
    # the Mixed norm's FP32 output must rejoin the half model as the others' half output does
    keep = lambda module, name: isinstance(module, nn.LayerNorm)  # noqa: E731
    losses, dtype = o5_losses(getattr(N, cls), keep_fp32=keep)
    ref, ref_dtype = o5_losses(nn.LayerNorm, keep_fp32=keep)
    assert dtype == ref_dtype == torch.float32 and losses[-1] < losses[0]
    torch.testing.assert_close(losses, ref, rtol=1e-2, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF)
def test_dtype_contract_on_cuda(dtype):
    ln, mixed = randomize(N.FusedLayerNorm(8)).cuda(), randomize(N.MixedFusedLayerNorm(8)).cuda()
    x = x_(dtype=dtype).cuda()
    assert ln(x).dtype == dtype and mixed(x).dtype == torch.float32
    with torch.autocast("cuda", dtype=dtype):
        assert ln(x.float()).dtype == dtype and mixed(x.float()).dtype == dtype
