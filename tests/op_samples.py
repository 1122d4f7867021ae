"""Sample inputs for every op in the default op lists.

``SAMPLES`` maps an op's qualified name (``torch.exp``,
``torch.nn.functional.linear``, ``torch.Tensor.__add__``, ``torch._VF.lstm``)
to a factory returning ``(args, kwargs)``. Inputs are FP32 (integer where the
op needs indices or targets), tiny, and deterministic: every call of
``make(qualname)`` returns new tensors holding the same values, so an in-place
op can be run once on the original and once patched. Values suit each op:
positive for ``log``, inside (-1, 1) for ``acos``, well-conditioned matrices
for the solvers, symmetric positive definite ones for Cholesky.

A Tensor method takes the sample of its function form with the receiver
first: ``torch.Tensor.X`` uses ``SAMPLES["torch.Tensor.X"]`` if there is one,
else the first of ``torch.X``, ``torch.nn.functional.X``, ``torch.linalg.X``,
``torch.special.X``, ``torch.fft.X``; an in-place ``X_`` (or ``__iX__``)
falls back to ``X`` (``__X__``) the same way, in any namespace.

``METHOD_FORM_EXCLUDED`` names the function ops whose same-named Tensor method
is a different op (another signature or result), so it is not their method form.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

Sample = Tuple[tuple, Dict[str, Any]]
Factory = Callable[["Rand"], Sample]

SAMPLES: Dict[str, Factory] = {}

#: function ops whose Tensor method of the same name is another op, and why
METHOD_FORM_EXCLUDED: Dict[str, str] = {
    "torch.linalg.cholesky": "Tensor.cholesky is torch.cholesky (an older op with an `upper` flag)",
    "torch.linalg.eig": "Tensor.eig was removed; it only raises",
    "torch.linalg.lstsq": "Tensor.lstsq was removed; it only raises",
    "torch.linalg.lu": "Tensor.lu is torch.lu (packed LU and pivots, not P, L, U)",
    "torch.linalg.lu_solve": "Tensor.lu_solve is torch.lu_solve (b, LU, pivots)",
    "torch.linalg.norm": "Tensor.norm is torch.norm (other defaults for matrices)",
    "torch.linalg.qr": "Tensor.qr is torch.qr (a `some` flag instead of `mode`)",
    "torch.linalg.solve": "Tensor.solve was removed; it only raises",
    "torch.linalg.svd": "Tensor.svd is torch.svd (returns V, not Vh)",
}


class Rand:
    """Deterministic small tensors; a fresh one per sample, seeded the same."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * scale

    def uniform(self, *shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(*shape, generator=self.g) * (hi - lo) + lo

    def positive(self, *shape: int) -> torch.Tensor:
        return self.uniform(*shape, lo=0.5, hi=2.0)

    def randint(self, high: int, *shape: int, low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.g)

    def well(self, n: int, *batch: int) -> torch.Tensor:
        """A well-conditioned square matrix (diagonally dominant)."""
        return self.randn(*batch, n, n, scale=0.2) + 2.0 * torch.eye(n)

    def spd(self, n: int, *batch: int) -> torch.Tensor:
        """A symmetric positive definite matrix with eigenvalues near 2."""
        a = self.randn(*batch, n, n, scale=0.2)
        return a @ a.transpose(-1, -2) + 2.0 * torch.eye(n)

    def lower(self, n: int) -> torch.Tensor:
        """A well-conditioned lower-triangular matrix (a Cholesky factor)."""
        return torch.linalg.cholesky(self.spd(n))

    def logits(self, *shape: int) -> torch.Tensor:
        return self.randn(*shape)

    def log_probs(self, *shape: int, dim: int = -1) -> torch.Tensor:
        return torch.log_softmax(self.randn(*shape), dim=dim)


def sample(*qualnames: str) -> Callable[[Factory], Factory]:
    """Register a factory under one or more qualified op names."""

    def register(fn: Factory) -> Factory:
        for q in qualnames:
            if q in SAMPLES:
                raise ValueError(f"two samples for {q}")
            SAMPLES[q] = fn
        return fn

    return register


def _both(*names: str) -> Tuple[str, ...]:
    """``torch.X`` and ``torch.nn.functional.X`` for ops with one signature in both."""
    return tuple(q for n in names for q in (f"torch.{n}", f"torch.nn.functional.{n}"))


#: where a Tensor method looks for the sample of its function form, in order
_FUNCTION_NAMESPACES = ("torch.Tensor", "torch", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft")


def lookup(qualname: str) -> Optional[Factory]:
    """The factory for ``qualname`` after the in-place and Tensor-method fallbacks, or None."""
    if qualname in SAMPLES:
        return SAMPLES[qualname]
    ns, _, name = qualname.rpartition(".")
    names = [name]
    if name.endswith("_") and not name.endswith("__"):
        names.append(name[:-1])
    elif name.startswith("__i") and name.endswith("__"):
        names.append(f"__{name[3:]}")
    if ns != "torch.Tensor":
        return next((SAMPLES[f"{ns}.{n}"] for n in names if f"{ns}.{n}" in SAMPLES), None)
    candidates = [f"{ns}.{n}" for n in names for ns in _FUNCTION_NAMESPACES]
    for c in candidates:
        if c in SAMPLES:
            return SAMPLES[c]
    return None


def make(qualname: str) -> Sample:
    """Fresh ``(args, kwargs)`` for ``qualname`` (KeyError when there is none)."""
    fn = lookup(qualname)
    if fn is None:
        raise KeyError(qualname)
    return fn(Rand())


# ------------------------------------------------------------ matmul family


@sample("torch.matmul", "torch.mm", "torch.linalg.matmul", "torch.Tensor.__matmul__")
def _mm(r):
    return (r.randn(3, 4), r.randn(4, 5)), {}


@sample("torch.Tensor.__rmatmul__")
def _rmm(r):
    return (r.randn(4, 5), r.randn(3, 4)), {}


@sample("torch.mv")
def _mv(r):
    return (r.randn(3, 4), r.randn(4)), {}


@sample("torch.bmm")
def _bmm(r):
    return (r.randn(2, 3, 4), r.randn(2, 4, 5)), {}


@sample("torch.addmm")
def _addmm(r):
    return (r.randn(3, 5), r.randn(3, 4), r.randn(4, 5)), {}


@sample("torch.addmv")
def _addmv(r):
    return (r.randn(3), r.randn(3, 4), r.randn(4)), {}


@sample("torch.addr")
def _addr(r):
    return (r.randn(3, 4), r.randn(3), r.randn(4)), {}


@sample("torch.addbmm")
def _addbmm(r):
    return (r.randn(3, 5), r.randn(2, 3, 4), r.randn(2, 4, 5)), {}


@sample("torch.baddbmm")
def _baddbmm(r):
    return (r.randn(2, 3, 5), r.randn(2, 3, 4), r.randn(2, 4, 5)), {}


@sample("torch.einsum")
def _einsum(r):
    return ("bij,bjk->bik", r.randn(2, 3, 4), r.randn(2, 4, 5)), {}


@sample("torch.chain_matmul")
def _chain_matmul(r):
    return (r.randn(3, 4), r.randn(4, 5), r.randn(5, 2)), {}


@sample("torch.linalg.multi_dot")
def _multi_dot(r):
    return ([r.randn(3, 4), r.randn(4, 5), r.randn(5, 2)],), {}


@sample("torch.linalg.vecdot")
def _vecdot(r):
    return (r.randn(3, 4), r.randn(3, 4)), {}


@sample("torch.dot", "torch.vdot")
def _dot(r):
    return (r.randn(5), r.randn(5)), {}


@sample("torch.tensordot")
def _tensordot(r):
    return (r.randn(3, 4, 2), r.randn(4, 2, 5)), {"dims": 2}


@sample("torch.nn.functional.linear")
def _linear(r):
    return (r.randn(3, 4), r.randn(5, 4), r.randn(5)), {}


@sample(*_both("bilinear"))
def _bilinear(r):
    return (r.randn(3, 4), r.randn(3, 2), r.randn(5, 4, 2), r.randn(5)), {}


@sample("torch.nn.functional.scaled_dot_product_attention")
def _sdpa(r):
    return (r.randn(1, 2, 3, 4), r.randn(1, 2, 5, 4), r.randn(1, 2, 5, 4)), {}


# ------------------------------------------------------------ convolutions


@sample(*_both("conv1d"))
def _conv1d(r):
    return (r.randn(2, 3, 6), r.randn(4, 3, 3), r.randn(4)), {}


@sample(*_both("conv2d"))
def _conv2d(r):
    return (r.randn(1, 2, 5, 5), r.randn(3, 2, 3, 3), r.randn(3)), {}


@sample(*_both("conv3d"))
def _conv3d(r):
    return (r.randn(1, 2, 4, 4, 4), r.randn(3, 2, 2, 2, 2), r.randn(3)), {}


@sample(*_both("conv_transpose1d"))
def _convt1d(r):
    return (r.randn(2, 3, 5), r.randn(3, 4, 3), r.randn(4)), {}


@sample(*_both("conv_transpose2d"))
def _convt2d(r):
    return (r.randn(1, 2, 4, 4), r.randn(2, 3, 3, 3), r.randn(3)), {}


@sample(*_both("conv_transpose3d"))
def _convt3d(r):
    return (r.randn(1, 2, 3, 3, 3), r.randn(2, 3, 2, 2, 2), r.randn(3)), {}


@sample(*_both("conv_tbc"))
def _conv_tbc(r):
    # (time, batch, channels), weight (width, in, out), bias (out,), pad
    return (r.randn(6, 2, 3), r.randn(3, 3, 4), r.randn(4), 1), {}


@sample("torch.convolution")
def _convolution(r):
    return (r.randn(1, 2, 5, 5), r.randn(3, 2, 3, 3), r.randn(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}


@sample("torch._convolution")
def _private_convolution(r):
    # the 12-argument overload torch's autocast tests use (benchmark, deterministic, cudnn_enabled)
    return (r.randn(1, 2, 5, 5), r.randn(3, 2, 3, 3), r.randn(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
            False, False, True), {}


@sample(*_both("prelu"))
def _prelu(r):
    return (r.randn(2, 3, 4), r.uniform(3, lo=0.1, hi=0.3)), {}


# ------------------------------------------------------------ recurrent kernels


def _cell_weights(r, gates: int, inp: int = 4, hid: int = 3):
    rows = gates * hid
    return r.randn(rows, inp, scale=0.3), r.randn(rows, hid, scale=0.3), r.randn(rows, scale=0.1), r.randn(rows, scale=0.1)


@sample("torch.lstm_cell", "torch._VF.lstm_cell")
def _lstm_cell(r):
    x, h, c = r.randn(2, 4), r.randn(2, 3), r.randn(2, 3)
    return (x, (h, c), *_cell_weights(r, 4)), {}


@sample("torch.gru_cell", "torch._VF.gru_cell")
def _gru_cell(r):
    return (r.randn(2, 4), r.randn(2, 3), *_cell_weights(r, 3)), {}


@sample("torch.rnn_tanh_cell", "torch.rnn_relu_cell", "torch._VF.rnn_tanh_cell", "torch._VF.rnn_relu_cell")
def _rnn_cell(r):
    return (r.randn(2, 4), r.randn(2, 3), *_cell_weights(r, 1)), {}


def _rnn(r, gates: int, lstm: bool):
    # (input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    x = r.randn(5, 2, 4)  # (seq, batch, feature)
    h = r.randn(1, 2, 3)
    hx = [h, r.randn(1, 2, 3)] if lstm else h
    return (x, hx, list(_cell_weights(r, gates)), True, 1, 0.0, False, False, False), {}


@sample("torch._VF.lstm")
def _lstm(r):
    return _rnn(r, 4, lstm=True)


@sample("torch._VF.gru")
def _gru(r):
    return _rnn(r, 3, lstm=False)


@sample("torch._VF.rnn_tanh", "torch._VF.rnn_relu")
def _rnn_plain(r):
    return _rnn(r, 1, lstm=False)


# ------------------------------------------------------------ pointwise


@sample("torch.acos", "torch.asin", "torch.erfinv", "torch.special.erfinv")
def _unit(r):
    return (r.uniform(3, 4, lo=-0.9, hi=0.9),), {}


@sample("torch.cosh", "torch.sinh", "torch.exp", "torch.expm1", "torch.exp2", "torch.special.expm1",
        "torch.special.exp2")
def _real(r):
    return (r.randn(3, 4),), {}


@sample("torch.tan")
def _tan(r):
    return (r.uniform(3, 4, lo=-1.2, hi=1.2),), {}


@sample("torch.log", "torch.log10", "torch.log2", "torch.log1p", "torch.special.log1p", "torch.reciprocal",
        "torch.rsqrt")
def _positive(r):
    return (r.positive(3, 4),), {}


@sample("torch.pow")
def _pow(r):
    return (r.positive(3, 4), r.uniform(3, 4, lo=-2.0, hi=2.0)), {}


@sample("torch.Tensor.__pow__")
def _dunder_pow(r):
    return (r.positive(3, 4), 2.5), {}


@sample("torch.Tensor.__rpow__")
def _dunder_rpow(r):
    return (r.randn(3, 4), 2.0), {}


@sample("torch.atan2")
def _atan2(r):
    return (r.randn(3, 4), r.randn(3, 4)), {}


@sample(
    "torch.Tensor.__add__", "torch.Tensor.__radd__", "torch.Tensor.__sub__", "torch.Tensor.__rsub__",
    "torch.Tensor.__mul__", "torch.Tensor.__rmul__", "torch.Tensor.__iadd__", "torch.Tensor.__isub__",
    "torch.Tensor.__imul__",
)
def _binary(r):
    return (r.randn(3, 4), r.randn(3, 4)), {}


@sample("torch.Tensor.__truediv__", "torch.Tensor.__rtruediv__", "torch.Tensor.__itruediv__")
def _divide(r):
    return (r.randn(3, 4), r.positive(3, 4)), {}


@sample("torch.addcmul")
def _addcmul(r):
    return (r.randn(3, 4), r.randn(3, 4), r.randn(3, 4)), {"value": 0.5}


@sample("torch.addcdiv")
def _addcdiv(r):
    return (r.randn(3, 4), r.randn(3, 4), r.positive(3, 4)), {"value": 0.5}


@sample("torch.cross")
def _cross(r):
    return (r.randn(4, 3), r.randn(4, 3)), {"dim": -1}


@sample("torch.polar")
def _polar(r):
    return (r.positive(3, 4), r.uniform(3, 4, lo=-3.0, hi=3.0)), {}


@sample("torch.view_as_complex")
def _view_as_complex(r):
    return (r.randn(3, 2),), {}


# ------------------------------------------------------------ reductions


@sample("torch.prod", "torch.cumprod")
def _prod(r):
    return (r.uniform(3, 4, lo=0.5, hi=1.5), 1), {}


@sample("torch.sum", "torch.cumsum")
def _sum(r):
    return (r.randn(3, 4), 1), {}


@sample(*_both("softmax", "log_softmax"), "torch.special.softmax", "torch.special.log_softmax",
        "torch.nn.functional.softmin")
def _softmax(r):
    return (r.randn(3, 4),), {"dim": -1}


@sample("torch.logsumexp", "torch.special.logsumexp")
def _logsumexp(r):
    return (r.randn(3, 4), 1), {}


@sample("torch.norm")
def _norm(r):
    return (r.randn(3, 4),), {"p": 2, "dim": 1}


@sample("torch.linalg.norm", "torch.linalg.matrix_norm")
def _matrix_norm(r):
    return (r.randn(3, 4),), {}


@sample("torch.linalg.vector_norm")
def _vector_norm(r):
    return (r.randn(3, 4),), {"ord": 3, "dim": 1}


@sample("torch.frobenius_norm")
def _frobenius_norm(r):
    return (r.randn(3, 4), [0, 1]), {}


@sample("torch.nuclear_norm")
def _nuclear_norm(r):
    return (r.randn(3, 4),), {}


@sample("torch.renorm")
def _renorm(r):
    return (r.randn(3, 4), 2, 0, 1.0), {}


@sample("torch.dist")
def _dist(r):
    return (r.randn(3, 4), r.randn(3, 4)), {"p": 3}


@sample("torch.trace")
def _trace(r):
    return (r.randn(4, 4),), {}


@sample("torch.quantile", "torch.nanquantile")
def _quantile(r):
    return (r.randn(3, 5), r.uniform(2)), {"dim": 1}


@sample("torch.cdist")
def _cdist(r):
    return (r.randn(3, 4), r.randn(5, 4)), {}


@sample(*_both("pdist"))
def _pdist(r):
    return (r.randn(4, 3),), {}


@sample(*_both("cosine_similarity"))
def _cosine_similarity(r):
    return (r.randn(3, 4), r.randn(3, 4)), {"dim": 1}


@sample("torch.nn.functional.normalize")
def _normalize(r):
    return (r.randn(3, 4),), {"dim": 1}


@sample("torch.stft")
def _stft(r):
    return (r.randn(32), 8), {"return_complex": True, "window": torch.hann_window(8)}


# ------------------------------------------------------------ normalization and activations


@sample(*_both("layer_norm"))
def _layer_norm(r):
    return (r.randn(2, 3, 4), [4], r.randn(4), r.randn(4)), {}


@sample("torch.native_layer_norm")
def _native_layer_norm(r):
    return (r.randn(2, 3, 4), [4], r.randn(4), r.randn(4), 1e-5), {}


@sample(*_both("group_norm"))
def _group_norm(r):
    return (r.randn(2, 4, 3), 2, r.randn(4), r.randn(4)), {}


@sample(*_both("rms_norm"))
def _rms_norm(r):
    return (r.randn(2, 3, 4), [4], r.positive(4)), {}


@sample("torch.nn.functional.softplus")
def _softplus(r):
    return (r.randn(3, 4, scale=3.0),), {}


@sample(*_both("rrelu"))
def _rrelu(r):
    # evaluation mode: the fixed slope (lower + upper) / 2, no random draw
    return (r.randn(2, 3, 4), 0.1, 0.3, False), {}


# ------------------------------------------------------------ resampling and pooling


@sample("torch.nn.functional.interpolate", "torch.nn.functional.upsample")
def _interpolate(r):
    return (r.randn(1, 2, 3, 3),), {"scale_factor": 2, "mode": "bilinear", "align_corners": False}


@sample("torch.nn.functional.upsample_nearest")
def _upsample_nearest(r):
    return (r.randn(1, 2, 3, 3),), {"scale_factor": 2}


@sample("torch.nn.functional.upsample_bilinear")
def _upsample_bilinear(r):
    return (r.randn(1, 2, 3, 3),), {"scale_factor": 2}


@sample("torch.nn.functional.grid_sample")
def _grid_sample(r):
    return (r.randn(1, 2, 4, 4), r.uniform(1, 3, 3, 2, lo=-1.0, hi=1.0)), {"align_corners": False}


@sample("torch.grid_sampler")
def _grid_sampler(r):
    # (input, grid, interpolation_mode=bilinear, padding_mode=zeros, align_corners)
    return (r.randn(1, 2, 4, 4), r.uniform(1, 3, 3, 2, lo=-1.0, hi=1.0), 0, 0, False), {}


@sample("torch.nn.functional.pad")
def _pad(r):
    # 2-D reflection padding: the call reaches reflection_pad2d
    return (r.randn(1, 2, 4, 4), (1, 1, 2, 1), "reflect"), {}


@sample(*_both("max_pool3d"), "torch.nn.functional.avg_pool3d")
def _pool3d(r):
    return (r.randn(1, 2, 4, 4, 4), 2), {}


@sample("torch.nn.functional.adaptive_avg_pool3d", "torch.nn.functional.adaptive_max_pool3d")
def _adaptive_pool3d(r):
    return (r.randn(1, 2, 4, 4, 4), 2), {}


@sample("torch.nn.functional.fractional_max_pool2d")
def _fractional2d(r):
    # Fixed samples make the op deterministic.
    return (r.randn(1, 2, 5, 5), 2), {"output_size": 3, "_random_samples": r.uniform(1, 2, 2)}


@sample("torch.nn.functional.fractional_max_pool3d")
def _fractional3d(r):
    return (r.randn(1, 2, 5, 5, 5), 2), {"output_size": 3, "_random_samples": r.uniform(1, 2, 3)}


@sample("torch.nn.functional.max_unpool2d")
def _unpool2d(r):
    _, idx = torch.nn.functional.max_pool2d(r.randn(1, 2, 4, 4), 2, return_indices=True)
    return (r.randn(1, 2, 2, 2), idx, 2), {}


@sample("torch.nn.functional.max_unpool1d")
def _unpool1d(r):
    _, idx = torch.nn.functional.max_pool1d(r.randn(1, 2, 6), 2, return_indices=True)
    return (r.randn(1, 2, 3), idx, 2), {}


@sample("torch.nn.functional.max_unpool3d")
def _unpool3d(r):
    _, idx = torch.nn.functional.max_pool3d(r.randn(1, 2, 4, 4, 4), 2, return_indices=True)
    return (r.randn(1, 2, 2, 2, 2), idx, 2), {}


# ------------------------------------------------------------ losses


@sample("torch.binary_cross_entropy_with_logits", "torch.nn.functional.binary_cross_entropy_with_logits")
def _bce_logits(r):
    return (r.logits(3, 4), r.uniform(3, 4)), {}


@sample("torch.nn.functional.binary_cross_entropy")
def _bce(r):
    return (r.uniform(3, 4, lo=0.05, hi=0.95), r.uniform(3, 4)), {}


@sample("torch.cosine_embedding_loss", "torch.nn.functional.cosine_embedding_loss")
def _cosine_embedding(r):
    return (r.randn(3, 4), r.randn(3, 4), r.randint(2, 3) * 2 - 1), {}


@sample("torch.hinge_embedding_loss", "torch.nn.functional.hinge_embedding_loss")
def _hinge(r):
    return (r.randn(3, 4), (r.randint(2, 3, 4) * 2 - 1).float()), {}


@sample("torch.kl_div")
def _kl_div(r):
    return (r.log_probs(3, 4), torch.softmax(r.randn(3, 4), -1)), {}


@sample("torch.nn.functional.kl_div")
def _f_kl_div(r):
    return (r.log_probs(3, 4), torch.softmax(r.randn(3, 4), -1)), {"reduction": "batchmean"}


@sample("torch.margin_ranking_loss", "torch.nn.functional.margin_ranking_loss")
def _margin_ranking(r):
    return (r.randn(5), r.randn(5), (r.randint(2, 5) * 2 - 1).float()), {}


@sample("torch.poisson_nll_loss")
def _poisson_nll(r):
    # (input, target, log_input, full, eps, reduction=mean)
    return (r.randn(3, 4), r.positive(3, 4), True, False, 1e-8, 1), {}


@sample("torch.nn.functional.poisson_nll_loss")
def _f_poisson_nll(r):
    return (r.randn(3, 4), r.positive(3, 4)), {}


@sample("torch.triplet_margin_loss", "torch.nn.functional.triplet_margin_loss")
def _triplet(r):
    return (r.randn(3, 4), r.randn(3, 4), r.randn(3, 4)), {}


def _ctc(r):
    t, n, c, s = 6, 2, 4, 3
    log_probs = r.log_probs(t, n, c)
    targets = r.randint(c, n, s, low=1)
    return log_probs, targets, torch.full((n,), t, dtype=torch.long), torch.full((n,), s, dtype=torch.long)


@sample("torch.ctc_loss", "torch.nn.functional.ctc_loss")
def _ctc_loss(r):
    return _ctc(r), {}


@sample("torch.nn.functional.cross_entropy")
def _cross_entropy(r):
    return (r.logits(3, 5), r.randint(5, 3)), {}


@sample("torch.nn.functional.nll_loss")
def _nll(r):
    return (r.log_probs(3, 5), r.randint(5, 3)), {}


@sample("torch.nn.functional.multi_margin_loss")
def _multi_margin(r):
    return (r.randn(3, 5), r.randint(5, 3)), {}


@sample("torch.nn.functional.multilabel_margin_loss")
def _multilabel_margin(r):
    target = torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1], [0, -1, 2, 1]])
    return (r.randn(3, 4), target), {}


@sample("torch.nn.functional.multilabel_soft_margin_loss")
def _multilabel_soft_margin(r):
    return (r.randn(3, 4), r.randint(2, 3, 4).float()), {}


@sample(
    "torch.nn.functional.huber_loss", "torch.nn.functional.l1_loss", "torch.nn.functional.mse_loss",
    "torch.nn.functional.smooth_l1_loss",
)
def _regression_loss(r):
    return (r.randn(3, 4), r.randn(3, 4)), {}


@sample("torch.nn.functional.soft_margin_loss")
def _soft_margin(r):
    return (r.randn(3, 4), (r.randint(2, 3, 4) * 2 - 1).float()), {}


# ------------------------------------------------------------ linear algebra


@sample("torch.cholesky", "torch.linalg.cholesky", "torch.linalg.cholesky_ex", "torch.linalg.eigh",
        "torch.linalg.eigvalsh")
def _spd(r):
    return (r.spd(3),), {}


@sample("torch.cholesky_inverse")
def _cholesky_inverse(r):
    return (r.lower(3),), {}


@sample("torch.cholesky_solve")
def _cholesky_solve(r):
    return (r.randn(3, 2), r.lower(3)), {}


@sample("torch.det", "torch.slogdet", "torch.logdet", "torch.lu", "torch.inverse", "torch.linalg.inv", "torch.linalg.inv_ex", "torch.linalg.det", "torch.linalg.slogdet",
        "torch.linalg.eig", "torch.linalg.eigvals", "torch.linalg.cond", "torch.linalg.lu",
        "torch.linalg.lu_factor", "torch.linalg.matrix_rank", "torch.linalg.svdvals")
def _square(r):
    return (r.well(3),), {}


@sample("torch.linalg.matrix_exp", "torch.matrix_exp")
def _matrix_exp(r):
    return (r.randn(3, 3, scale=0.3),), {}


@sample("torch.pinverse", "torch.linalg.pinv", "torch.qr", "torch.linalg.qr", "torch.svd", "torch.linalg.svd",
        "torch.geqrf")
def _tall(r):
    return (r.randn(4, 3) + torch.eye(4, 3),), {}


@sample("torch.lu_solve")
def _lu_solve(r):
    lu, piv = torch.linalg.lu_factor(r.well(3))
    return (r.randn(3, 2), lu, piv), {}


@sample("torch.linalg.lu_solve")
def _linalg_lu_solve(r):
    lu, piv = torch.linalg.lu_factor(r.well(3))
    return (lu, piv, r.randn(3, 2)), {}


def _householder(r):
    a, tau = torch.geqrf(r.randn(4, 3) + torch.eye(4, 3))
    return a, tau


@sample("torch.orgqr", "torch.linalg.householder_product")
def _orgqr(r):
    return _householder(r), {}


@sample("torch.ormqr")
def _ormqr(r):
    a, tau = _householder(r)
    return (a, tau, r.randn(4, 2)), {}


@sample("torch.triangular_solve")
def _triangular_solve(r):
    return (r.randn(3, 2), r.lower(3)), {"upper": False}


@sample("torch.linalg.solve_triangular")
def _solve_triangular(r):
    return (r.lower(3), r.randn(3, 2)), {"upper": False}


@sample("torch.linalg.solve", "torch.linalg.solve_ex")
def _solve(r):
    return (r.well(3), r.randn(3, 2)), {}


@sample("torch.linalg.lstsq")
def _lstsq(r):
    # The default driver (gelsy) can round differently from call to call on
    # CPU, depending on memory alignment; plain QR (gels) is reproducible.
    return (r.well(3), r.randn(3, 2)), {"driver": "gels"}


@sample("torch.linalg.tensorinv")
def _tensorinv(r):
    return (r.well(6).reshape(6, 2, 3),), {"ind": 1}


@sample("torch.linalg.tensorsolve")
def _tensorsolve(r):
    return (r.well(6).reshape(2, 3, 6), r.randn(2, 3)), {}


# ------------------------------------------------------------ FFT
# A real input for every transform: the policy casts real floating tensors
# only. The inverse real and Hermitian transforms (irfft, hfft, ...) read a
# real input as complex with a zero imaginary part, so it suits them too.


def _fft_names(*dims: str) -> Tuple[str, ...]:
    return tuple(f"torch.fft.{kind}{d}" for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft") for d in dims)


@sample(*_fft_names(""))
def _fft_1d(r):
    return (r.randn(8),), {}


@sample(*_fft_names("2", "n"))
def _fft_2d(r):
    return (r.randn(4, 8),), {}


# ------------------------------------------------------------ indexing and joining


@sample("torch.nn.functional.embedding_bag")
def _embedding_bag(r):
    # the weight, then per-sample weights: the two must share a dtype
    return (r.randint(10, 2, 3), r.randn(10, 4)), {"mode": "sum", "per_sample_weights": r.uniform(2, 3)}


@sample("torch.index_put")
def _index_put(r):
    return (r.randn(5, 3), (torch.tensor([0, 2, 4]),), r.randn(3, 3)), {}


@sample("torch.scatter_add")
def _scatter_add(r):
    return (r.randn(3, 5), 1, r.randint(5, 3, 4), r.randn(3, 4)), {}


@sample("torch.index_copy")
def _index_copy(r):
    return (r.randn(5, 3), 0, torch.tensor([0, 2, 4]), r.randn(3, 3)), {}


@sample("torch.cat", "torch.concat", "torch.concatenate", "torch.stack", "torch.hstack", "torch.vstack", "torch.dstack")
def _sequence(r):
    return ([r.randn(2, 3), r.randn(2, 3)],), {}


# ------------------------------------------------------------ fused inference kernels


def _attention_weights(r, e: int):
    return r.randn(3 * e, e, scale=0.3), r.randn(3 * e, scale=0.1), r.randn(e, e, scale=0.3), r.randn(e, scale=0.1)


@sample("torch._addmm_activation")
def _addmm_activation(r):
    return (r.randn(3), r.randn(2, 4), r.randn(4, 3)), {"use_gelu": True}


@sample("torch._native_multi_head_attention")
def _native_mha(r):
    q = r.randn(2, 3, 8)
    # (query, key, value, embed_dim, num_heads, qkv weight and bias, out weight and bias)
    return (q, q, q, 8, 2, *_attention_weights(r, 8)), {"need_weights": False}


@sample("torch._transformer_encoder_layer_fwd")
def _encoder_layer(r):
    e, ff = 8, 16
    norms = (1.0 + r.randn(e, scale=0.1), r.randn(e, scale=0.1), 1.0 + r.randn(e, scale=0.1), r.randn(e, scale=0.1))
    ffn = (r.randn(ff, e, scale=0.3), r.randn(ff, scale=0.1), r.randn(e, ff, scale=0.3), r.randn(e, scale=0.1))
    # (src, embed_dim, num_heads, attention weights, use_gelu, norm_first, eps, norms, feed-forward)
    return (r.randn(2, 3, e), e, 2, *_attention_weights(r, e), False, False, 1e-5, *norms, *ffn), {}
