"""Every layer torch.nn ships, under amp_patch, against ``torch.autocast`` and FP32.

The layers are torch.nn's own list (``torch.nn.modules.__all__``), so a layer a
newer torch adds joins by itself, and fails until ``LAYERS`` says how to build
and feed it or ``EXCLUDED`` says why it has no run of its own. One test per
layer and opt level; in it the layer, in training mode, runs a forward and a
backward (of a fixed random projection of every floating output) on each route:

(a) fed the FP32 input as it is;
(b) fed through an identity ``nn.Linear``, which O1 runs in half as autocast
    does: the layer gets a half input, as behind any matmul in a model.

* At O1 (FP16) and O4 (BF16), against the same layer under
  ``torch.autocast("cpu", dtype=...)``: every floating output and every
  gradient (inputs, parameters) has autocast's dtype, and the values agree
  within what the half dtype resolves.
* At O2 (FP16) and O5 (BF16), against the layer in FP32: the outputs come back
  FP32, the gradients of the inputs and of the FP32 masters are FP32, and the
  values agree with FP32's within what a layer computed in half can give.

Where O1/O4 differ from CPU autocast by design (docs/guide.md, "Parity with
torch.autocast"), ``DIFFERENCES`` gives what amp_patch computes instead, with
the guide's reason.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

import amp_patch
from amp_patch import oplists
from amp_patch.base.errors import BannedOpError, ConfigError
from amp_patch.precision import model as model_side
from helpers import amp

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = [
    pytest.mark.filterwarnings("ignore:Lazy modules are a new feature:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*deprecated.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    # a norm given a half input with FP32 weights runs torch's unfused kernel, as under autocast
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
]


# ------------------------------------------------------------------ inputs

def r(*shape: int) -> torch.Tensor:
    """Standard normal values."""
    return torch.randn(*shape)


def u(*shape: int) -> torch.Tensor:
    """Values in (0.05, 0.95): probabilities, and what must stay positive."""
    return torch.rand(*shape) * 0.9 + 0.05


def sign(*shape: int) -> torch.Tensor:
    """Targets of +1 and -1 (margin and embedding losses)."""
    return torch.randint(0, 2, shape).float() * 2 - 1


def ids(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape)


def pooled(pool: Callable, *shape: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A max pool's values and indices, for the MaxUnpool layers."""
    return pool(r(*shape), 2, return_indices=True)


def ctc_inputs() -> tuple:
    """log_probs (T=6, N=2, C=5), targets, input and target lengths."""
    return (r(6, 2, 5).log_softmax(-1), torch.randint(1, 5, (2, 3)), torch.tensor([6, 5]), torch.tensor([3, 2]))


def multilabel_targets() -> torch.Tensor:
    """MultiLabelMarginLoss's class indices, ended by -1."""
    return torch.tensor([[3, 0, -1, 1], [1, -1, 0, 2]])


def encoder_layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0)


def decoder_layer() -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(4, 2, dim_feedforward=8, dropout=0.0)


# ------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class Layer:
    """How to build one layer and what to call it with.

    ``inputs`` returns the positional arguments; the first floating tensor
    among them is the one route (b) feeds through the identity ``Linear``.
    """

    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    #: positions of the inputs whose gradients are taken (None: every floating one)
    wrt: Optional[Tuple[int, ...]] = None


def loss(make: Callable[[], nn.Module], inputs: Callable[[], tuple], wrt: Tuple[int, ...] = (0,)) -> Layer:
    """A loss: gradients of the prediction (and of ``wrt``), not of the target."""
    return Layer(make, inputs, wrt)


#: torch.nn's classes that have no run of their own, and why
EXCLUDED: Dict[str, str] = {
    "Module": "the base class of every layer; it computes nothing",
    "Container": "a deprecated base class of the containers; it computes nothing",
    "Sequential": "a container: it runs its children, which are here",
    "ModuleList": "a container: it has no forward",
    "ModuleDict": "a container: it has no forward",
    "ParameterList": "a container of parameters: it has no forward",
    "ParameterDict": "a container of parameters: it has no forward",
    "RNNBase": "the abstract base of RNN, LSTM and GRU, which are here; it has no forward",
    "RNNCellBase": "the abstract base of the RNN cells, which are here; it has no forward",
}

#: every other class of torch.nn: constructor arguments and inputs, tiny shapes
LAYERS: Dict[str, Layer] = {
    # convolutions
    "Conv1d": Layer(lambda: nn.Conv1d(3, 4, 3), lambda: (r(2, 3, 6),)),
    "Conv2d": Layer(lambda: nn.Conv2d(3, 4, 3), lambda: (r(2, 3, 5, 5),)),
    "Conv3d": Layer(lambda: nn.Conv3d(3, 4, 2), lambda: (r(2, 3, 3, 4, 4),)),
    "ConvTranspose1d": Layer(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), lambda: (r(2, 3, 5),)),
    "ConvTranspose2d": Layer(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), lambda: (r(2, 3, 4, 4),)),
    "ConvTranspose3d": Layer(lambda: nn.ConvTranspose3d(3, 4, 2, stride=2), lambda: (r(2, 3, 2, 3, 3),)),
    # lazy forms: built unmaterialized; their first forward (under amp_patch) sizes them
    "LazyConv1d": Layer(lambda: nn.LazyConv1d(4, 3), lambda: (r(2, 3, 6),)),
    "LazyConv2d": Layer(lambda: nn.LazyConv2d(4, 3), lambda: (r(2, 3, 5, 5),)),
    "LazyConv3d": Layer(lambda: nn.LazyConv3d(4, 2), lambda: (r(2, 3, 3, 4, 4),)),
    "LazyConvTranspose1d": Layer(lambda: nn.LazyConvTranspose1d(4, 3, stride=2), lambda: (r(2, 3, 5),)),
    "LazyConvTranspose2d": Layer(lambda: nn.LazyConvTranspose2d(4, 3, stride=2), lambda: (r(2, 3, 4, 4),)),
    "LazyConvTranspose3d": Layer(lambda: nn.LazyConvTranspose3d(4, 2, stride=2), lambda: (r(2, 3, 2, 3, 3),)),
    "Fold": Layer(lambda: nn.Fold(output_size=(4, 4), kernel_size=2), lambda: (r(2, 12, 9),)),
    "Unfold": Layer(lambda: nn.Unfold(kernel_size=2), lambda: (r(2, 3, 4, 4),)),
    # linear
    "Identity": Layer(nn.Identity, lambda: (r(2, 4),)),
    "Linear": Layer(lambda: nn.Linear(4, 5), lambda: (r(2, 4),)),
    "LazyLinear": Layer(lambda: nn.LazyLinear(5), lambda: (r(2, 4),)),
    "Bilinear": Layer(lambda: nn.Bilinear(4, 3, 5), lambda: (r(2, 4), r(2, 3))),
    # recurrent layers and cells
    "RNN": Layer(lambda: nn.RNN(4, 5, num_layers=2, nonlinearity="relu"), lambda: (r(3, 2, 4),)),
    "LSTM": Layer(lambda: nn.LSTM(4, 5, num_layers=2, bidirectional=True), lambda: (r(3, 2, 4),)),
    "GRU": Layer(lambda: nn.GRU(4, 5, num_layers=2, batch_first=True), lambda: (r(2, 3, 4),)),
    "RNNCell": Layer(lambda: nn.RNNCell(4, 5), lambda: (r(2, 4),)),
    "LSTMCell": Layer(lambda: nn.LSTMCell(4, 5), lambda: (r(2, 4),)),
    "GRUCell": Layer(lambda: nn.GRUCell(4, 5), lambda: (r(2, 4),)),
    # attention and transformers (no dropout: the values must be comparable)
    "MultiheadAttention": Layer(lambda: nn.MultiheadAttention(4, 2), lambda: (r(3, 2, 4), r(3, 2, 4), r(3, 2, 4))),
    "TransformerEncoderLayer": Layer(encoder_layer, lambda: (r(3, 2, 4),)),
    "TransformerDecoderLayer": Layer(decoder_layer, lambda: (r(3, 2, 4), r(3, 2, 4))),
    "TransformerEncoder": Layer(lambda: nn.TransformerEncoder(encoder_layer(), 1, norm=nn.LayerNorm(4),
                                                              enable_nested_tensor=False), lambda: (r(3, 2, 4),)),
    "TransformerDecoder": Layer(lambda: nn.TransformerDecoder(decoder_layer(), 1, norm=nn.LayerNorm(4)),
                                lambda: (r(3, 2, 4), r(3, 2, 4))),
    "Transformer": Layer(lambda: nn.Transformer(4, 2, 1, 1, dim_feedforward=8, dropout=0.0),
                         lambda: (r(3, 2, 4), r(2, 2, 4))),
    # normalization
    "BatchNorm1d": Layer(lambda: nn.BatchNorm1d(3), lambda: (r(2, 3, 5),)),
    "BatchNorm2d": Layer(lambda: nn.BatchNorm2d(3), lambda: (r(2, 3, 4, 4),)),
    "BatchNorm3d": Layer(lambda: nn.BatchNorm3d(3), lambda: (r(2, 3, 2, 4, 4),)),
    "LazyBatchNorm1d": Layer(nn.LazyBatchNorm1d, lambda: (r(2, 3, 5),)),
    "LazyBatchNorm2d": Layer(nn.LazyBatchNorm2d, lambda: (r(2, 3, 4, 4),)),
    "LazyBatchNorm3d": Layer(nn.LazyBatchNorm3d, lambda: (r(2, 3, 2, 4, 4),)),
    "SyncBatchNorm": Layer(lambda: nn.SyncBatchNorm(3), lambda: (r(2, 3, 4, 4),)),  # one process: batch norm
    "InstanceNorm1d": Layer(lambda: nn.InstanceNorm1d(3, affine=True), lambda: (r(2, 3, 5),)),
    "InstanceNorm2d": Layer(lambda: nn.InstanceNorm2d(3, affine=True), lambda: (r(2, 3, 4, 4),)),
    "InstanceNorm3d": Layer(lambda: nn.InstanceNorm3d(3, affine=True), lambda: (r(2, 3, 2, 4, 4),)),
    "LazyInstanceNorm1d": Layer(lambda: nn.LazyInstanceNorm1d(affine=True), lambda: (r(2, 3, 5),)),
    "LazyInstanceNorm2d": Layer(lambda: nn.LazyInstanceNorm2d(affine=True), lambda: (r(2, 3, 4, 4),)),
    "LazyInstanceNorm3d": Layer(lambda: nn.LazyInstanceNorm3d(affine=True), lambda: (r(2, 3, 2, 4, 4),)),
    "LayerNorm": Layer(lambda: nn.LayerNorm(4), lambda: (r(2, 3, 4),)),
    "GroupNorm": Layer(lambda: nn.GroupNorm(2, 4), lambda: (r(2, 4, 5),)),
    "RMSNorm": Layer(lambda: nn.RMSNorm(4), lambda: (r(2, 3, 4),)),
    "LocalResponseNorm": Layer(lambda: nn.LocalResponseNorm(2), lambda: (r(2, 3, 4, 4),)),
    "CrossMapLRN2d": Layer(lambda: nn.CrossMapLRN2d(3), lambda: (r(2, 3, 4, 4),)),
    # embeddings (integer inputs: EmbeddingBag's per-sample weights are its floating input)
    "Embedding": Layer(lambda: nn.Embedding(10, 4), lambda: (ids(10, 2, 3),)),
    "EmbeddingBag": Layer(lambda: nn.EmbeddingBag(10, 4, mode="sum"), lambda: (ids(10, 2, 3), None, u(2, 3))),
    # pooling
    "AvgPool1d": Layer(lambda: nn.AvgPool1d(2), lambda: (r(2, 3, 6),)),
    "AvgPool2d": Layer(lambda: nn.AvgPool2d(2), lambda: (r(2, 3, 4, 4),)),
    "AvgPool3d": Layer(lambda: nn.AvgPool3d(2), lambda: (r(2, 3, 4, 4, 4),)),
    "MaxPool1d": Layer(lambda: nn.MaxPool1d(2), lambda: (r(2, 3, 6),)),
    "MaxPool2d": Layer(lambda: nn.MaxPool2d(2), lambda: (r(2, 3, 4, 4),)),
    "MaxPool3d": Layer(lambda: nn.MaxPool3d(2), lambda: (r(2, 3, 4, 4, 4),)),
    "AdaptiveAvgPool1d": Layer(lambda: nn.AdaptiveAvgPool1d(2), lambda: (r(2, 3, 5),)),
    "AdaptiveAvgPool2d": Layer(lambda: nn.AdaptiveAvgPool2d(2), lambda: (r(2, 3, 5, 5),)),
    "AdaptiveAvgPool3d": Layer(lambda: nn.AdaptiveAvgPool3d(2), lambda: (r(2, 3, 3, 5, 5),)),
    "AdaptiveMaxPool1d": Layer(lambda: nn.AdaptiveMaxPool1d(2), lambda: (r(2, 3, 5),)),
    "AdaptiveMaxPool2d": Layer(lambda: nn.AdaptiveMaxPool2d(2), lambda: (r(2, 3, 5, 5),)),
    "AdaptiveMaxPool3d": Layer(lambda: nn.AdaptiveMaxPool3d(2), lambda: (r(2, 3, 3, 5, 5),)),
    "MaxUnpool1d": Layer(lambda: nn.MaxUnpool1d(2), lambda: pooled(nn.functional.max_pool1d, 2, 3, 6)),
    "MaxUnpool2d": Layer(lambda: nn.MaxUnpool2d(2), lambda: pooled(nn.functional.max_pool2d, 2, 3, 4, 4)),
    "MaxUnpool3d": Layer(lambda: nn.MaxUnpool3d(2), lambda: pooled(nn.functional.max_pool3d, 2, 3, 4, 4, 4)),
    "FractionalMaxPool2d": Layer(lambda: nn.FractionalMaxPool2d(2, output_size=2), lambda: (r(2, 3, 5, 5),)),
    "FractionalMaxPool3d": Layer(lambda: nn.FractionalMaxPool3d(2, output_size=2), lambda: (r(2, 3, 5, 5, 5),)),
    "LPPool1d": Layer(lambda: nn.LPPool1d(2, 2), lambda: (r(2, 3, 6),)),
    "LPPool2d": Layer(lambda: nn.LPPool2d(2, 2), lambda: (r(2, 3, 4, 4),)),
    "LPPool3d": Layer(lambda: nn.LPPool3d(2, 2), lambda: (r(2, 3, 4, 4, 4),)),
    # padding
    "ConstantPad1d": Layer(lambda: nn.ConstantPad1d(1, 0.5), lambda: (r(2, 3, 4),)),
    "ConstantPad2d": Layer(lambda: nn.ConstantPad2d(1, 0.5), lambda: (r(2, 3, 4, 4),)),
    "ConstantPad3d": Layer(lambda: nn.ConstantPad3d(1, 0.5), lambda: (r(2, 3, 2, 4, 4),)),
    "ZeroPad1d": Layer(lambda: nn.ZeroPad1d(1), lambda: (r(2, 3, 4),)),
    "ZeroPad2d": Layer(lambda: nn.ZeroPad2d(1), lambda: (r(2, 3, 4, 4),)),
    "ZeroPad3d": Layer(lambda: nn.ZeroPad3d(1), lambda: (r(2, 3, 2, 4, 4),)),
    "ReflectionPad1d": Layer(lambda: nn.ReflectionPad1d(1), lambda: (r(2, 3, 4),)),
    "ReflectionPad2d": Layer(lambda: nn.ReflectionPad2d(1), lambda: (r(2, 3, 4, 4),)),
    "ReflectionPad3d": Layer(lambda: nn.ReflectionPad3d(1), lambda: (r(2, 3, 2, 4, 4),)),
    "ReplicationPad1d": Layer(lambda: nn.ReplicationPad1d(1), lambda: (r(2, 3, 4),)),
    "ReplicationPad2d": Layer(lambda: nn.ReplicationPad2d(1), lambda: (r(2, 3, 4, 4),)),
    "ReplicationPad3d": Layer(lambda: nn.ReplicationPad3d(1), lambda: (r(2, 3, 2, 4, 4),)),
    "CircularPad1d": Layer(lambda: nn.CircularPad1d(1), lambda: (r(2, 3, 4),)),
    "CircularPad2d": Layer(lambda: nn.CircularPad2d(1), lambda: (r(2, 3, 4, 4),)),
    "CircularPad3d": Layer(lambda: nn.CircularPad3d(1), lambda: (r(2, 3, 2, 4, 4),)),
    # reshaping and resampling
    "Flatten": Layer(nn.Flatten, lambda: (r(2, 3, 4),)),
    "Unflatten": Layer(lambda: nn.Unflatten(1, (2, 2)), lambda: (r(2, 4, 3),)),
    "PixelShuffle": Layer(lambda: nn.PixelShuffle(2), lambda: (r(2, 8, 2, 2),)),
    "PixelUnshuffle": Layer(lambda: nn.PixelUnshuffle(2), lambda: (r(2, 2, 4, 4),)),
    "ChannelShuffle": Layer(lambda: nn.ChannelShuffle(2), lambda: (r(2, 4, 3, 3),)),
    "Upsample": Layer(lambda: nn.Upsample(scale_factor=2, mode="bilinear"), lambda: (r(2, 3, 4, 4),)),
    "UpsamplingBilinear2d": Layer(lambda: nn.UpsamplingBilinear2d(scale_factor=2), lambda: (r(2, 3, 4, 4),)),
    "UpsamplingNearest2d": Layer(lambda: nn.UpsamplingNearest2d(scale_factor=2), lambda: (r(2, 3, 4, 4),)),
    # dropout (the same seed before every forward: the same masks in every run)
    "Dropout": Layer(lambda: nn.Dropout(0.5), lambda: (r(2, 3, 4),)),
    "Dropout1d": Layer(lambda: nn.Dropout1d(0.5), lambda: (r(2, 3, 4),)),
    "Dropout2d": Layer(lambda: nn.Dropout2d(0.5), lambda: (r(2, 3, 4, 4),)),
    "Dropout3d": Layer(lambda: nn.Dropout3d(0.5), lambda: (r(2, 3, 2, 4, 4),)),
    "AlphaDropout": Layer(lambda: nn.AlphaDropout(0.5), lambda: (r(2, 3, 4),)),
    "FeatureAlphaDropout": Layer(lambda: nn.FeatureAlphaDropout(0.5), lambda: (r(2, 3, 4, 4),)),
    # activations
    "CELU": Layer(nn.CELU, lambda: (r(2, 3, 4),)),
    "ELU": Layer(nn.ELU, lambda: (r(2, 3, 4),)),
    "GELU": Layer(nn.GELU, lambda: (r(2, 3, 4),)),
    "GLU": Layer(nn.GLU, lambda: (r(2, 3, 4),)),
    "Hardshrink": Layer(nn.Hardshrink, lambda: (r(2, 3, 4),)),
    "Hardsigmoid": Layer(nn.Hardsigmoid, lambda: (r(2, 3, 4),)),
    "Hardswish": Layer(nn.Hardswish, lambda: (r(2, 3, 4),)),
    "Hardtanh": Layer(nn.Hardtanh, lambda: (r(2, 3, 4),)),
    "LeakyReLU": Layer(nn.LeakyReLU, lambda: (r(2, 3, 4),)),
    "LogSigmoid": Layer(nn.LogSigmoid, lambda: (r(2, 3, 4),)),
    "LogSoftmax": Layer(lambda: nn.LogSoftmax(dim=-1), lambda: (r(2, 3, 4),)),
    "Mish": Layer(nn.Mish, lambda: (r(2, 3, 4),)),
    "PReLU": Layer(lambda: nn.PReLU(3), lambda: (r(2, 3, 4),)),
    "RReLU": Layer(nn.RReLU, lambda: (r(2, 3, 4),)),
    "ReLU": Layer(nn.ReLU, lambda: (r(2, 3, 4),)),
    "ReLU6": Layer(nn.ReLU6, lambda: (r(2, 3, 4) * 4,)),
    "SELU": Layer(nn.SELU, lambda: (r(2, 3, 4),)),
    "SiLU": Layer(nn.SiLU, lambda: (r(2, 3, 4),)),
    "Sigmoid": Layer(nn.Sigmoid, lambda: (r(2, 3, 4),)),
    "Softmax": Layer(lambda: nn.Softmax(dim=-1), lambda: (r(2, 3, 4),)),
    "Softmax2d": Layer(nn.Softmax2d, lambda: (r(2, 3, 4, 4),)),
    "Softmin": Layer(lambda: nn.Softmin(dim=-1), lambda: (r(2, 3, 4),)),
    "Softplus": Layer(nn.Softplus, lambda: (r(2, 3, 4),)),
    "Softshrink": Layer(nn.Softshrink, lambda: (r(2, 3, 4),)),
    "Softsign": Layer(nn.Softsign, lambda: (r(2, 3, 4),)),
    "Tanh": Layer(nn.Tanh, lambda: (r(2, 3, 4),)),
    "Tanhshrink": Layer(nn.Tanhshrink, lambda: (r(2, 3, 4),)),
    "Threshold": Layer(lambda: nn.Threshold(0.1, -1.0), lambda: (r(2, 3, 4),)),
    # distances
    "CosineSimilarity": Layer(nn.CosineSimilarity, lambda: (r(2, 4), r(2, 4))),
    "PairwiseDistance": Layer(nn.PairwiseDistance, lambda: (r(2, 4), r(2, 4))),
    # losses: (prediction, target, ...)
    "L1Loss": loss(nn.L1Loss, lambda: (r(2, 4), r(2, 4))),
    "MSELoss": loss(nn.MSELoss, lambda: (r(2, 4), r(2, 4))),
    "HuberLoss": loss(nn.HuberLoss, lambda: (r(2, 4) * 2, r(2, 4))),
    "SmoothL1Loss": loss(nn.SmoothL1Loss, lambda: (r(2, 4) * 2, r(2, 4))),
    "BCELoss": loss(nn.BCELoss, lambda: (u(2, 4), u(2, 4))),
    "BCEWithLogitsLoss": loss(nn.BCEWithLogitsLoss, lambda: (r(2, 4), u(2, 4))),
    "CrossEntropyLoss": loss(nn.CrossEntropyLoss, lambda: (r(2, 5), ids(5, 2))),
    "NLLLoss": loss(nn.NLLLoss, lambda: (r(2, 5).log_softmax(-1), ids(5, 2))),
    "NLLLoss2d": loss(nn.NLLLoss2d, lambda: (r(2, 3, 4, 4).log_softmax(1), ids(3, 2, 4, 4))),
    "KLDivLoss": loss(lambda: nn.KLDivLoss(reduction="batchmean"), lambda: (r(2, 4).log_softmax(-1), u(2, 4))),
    "PoissonNLLLoss": loss(nn.PoissonNLLLoss, lambda: (r(2, 4), u(2, 4) * 3)),
    "GaussianNLLLoss": loss(nn.GaussianNLLLoss, lambda: (r(2, 4), r(2, 4), u(2, 4)), wrt=(0, 2)),
    "CTCLoss": loss(nn.CTCLoss, ctc_inputs),
    "MarginRankingLoss": loss(nn.MarginRankingLoss, lambda: (r(4), r(4), sign(4)), wrt=(0, 1)),
    "HingeEmbeddingLoss": loss(nn.HingeEmbeddingLoss, lambda: (r(2, 4), sign(2, 4))),
    "CosineEmbeddingLoss": loss(nn.CosineEmbeddingLoss, lambda: (r(2, 4), r(2, 4), sign(2)), wrt=(0, 1)),
    "SoftMarginLoss": loss(nn.SoftMarginLoss, lambda: (r(2, 4), sign(2, 4))),
    "MultiLabelMarginLoss": loss(nn.MultiLabelMarginLoss, lambda: (r(2, 4), multilabel_targets())),
    "MultiLabelSoftMarginLoss": loss(nn.MultiLabelSoftMarginLoss, lambda: (r(2, 4), u(2, 4).round())),
    "MultiMarginLoss": loss(nn.MultiMarginLoss, lambda: (r(2, 4), ids(4, 2))),
    "TripletMarginLoss": loss(nn.TripletMarginLoss, lambda: (r(2, 4), r(2, 4), r(2, 4)), wrt=(0, 1, 2)),
    "TripletMarginWithDistanceLoss": loss(nn.TripletMarginWithDistanceLoss, lambda: (r(2, 4), r(2, 4), r(2, 4)),
                                          wrt=(0, 1, 2)),
    "AdaptiveLogSoftmaxWithLoss": loss(lambda: nn.AdaptiveLogSoftmaxWithLoss(4, 6, cutoffs=[3]),
                                       lambda: (r(5, 4), ids(6, 5))),
    "LinearCrossEntropyLoss": loss(lambda: nn.LinearCrossEntropyLoss(4, 5, bias=True), lambda: (r(2, 4), ids(5, 2))),
}


def torch_nn_layers() -> List[str]:
    """Every nn.Module class torch.nn exports, from its own list."""
    return sorted(n for n in nn.modules.__all__
                  if isinstance(getattr(nn.modules, n), type) and issubclass(getattr(nn.modules, n), nn.Module))


CLASSES = [n for n in torch_nn_layers() if n not in EXCLUDED]


def test_every_torch_nn_layer_has_an_entry():
    """A class torch.nn ships with neither an entry nor a reason fails here
    (its parametrized runs below fail too); an entry for a class torch.nn no
    longer has is stale."""
    shipped = set(torch_nn_layers())
    missing = sorted(shipped - set(LAYERS) - set(EXCLUDED))
    stale = sorted((set(LAYERS) | set(EXCLUDED)) - shipped)
    assert not missing, f"torch.nn layers with no entry in LAYERS or EXCLUDED: {missing}"
    assert not stale, f"entries for classes torch.nn does not have: {stale}"
    assert not set(LAYERS) & set(EXCLUDED)


# ------------------------------------------------------------------ where amp_patch differs from CPU autocast


@dataclasses.dataclass(frozen=True)
class Differs:
    """What O1/O4 give for a layer where they knowingly differ from CPU autocast.

    ``outputs(half, given)``: the output dtypes, from the half dtype and the
    dtype the layer is given (FP32 on route a, half on route b); the values are
    then held to FP32's, as no autocast run computes the same thing.
    ``autocast_fails``: torch.autocast raises on it (checked, so the entry goes
    when torch changes). ``raises``: amp_patch refuses the layer with this error.
    """

    why: str
    outputs: Callable[[torch.dtype, torch.dtype], List[torch.dtype]] = lambda half, given: []
    autocast_fails: bool = False
    raises: Optional[type] = None


def fp32(half, given):
    return [f32]


def as_given(half, given):
    return [given]


def halves(n: int) -> Callable:
    return lambda half, given: [half] * n


def cuda_fp32(op: str) -> str:
    return (f"docs/guide.md, Parity: under FP16 amp_patch follows CUDA autocast's policy, which runs {op} in FP32; "
            f"CPU autocast applies its BF16 lists to FP16 and leaves {op} in the dtype it is given")


def cpu_fp32(op: str) -> str:
    return (f"docs/guide.md, Parity: under FP16 amp_patch follows CUDA autocast's policy, which has none for {op}: "
            f"it keeps the dtype it is given; CPU autocast runs it in FP32")


RNN_STATE = ("docs/guide.md, Parity (RNN hidden state): CPU FP16 runs cast the recurrent state to half as CUDA "
             "autocast's cells and cuDNN do (and Apex did); CPU autocast keeps an FP32 state FP32")
PROMOTED = ("docs/guide.md, Parity (Promotion): {op} is a promote op, run in FP32 on a mix of half and FP32 inputs; "
            "CPU autocast has no policy for it and its kernel refuses the mix")

#: (layer, half dtype, route: fed through the Linear, or None for both) -> Differs
DIFFERENCES: Dict[Tuple[str, torch.dtype, Optional[bool]], Differs] = {
    **{(n, f16, None): Differs(cuda_fp32("layer_norm"), fp32) for n in ("LayerNorm", "TransformerEncoderLayer",
       "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder", "Transformer")},
    ("GroupNorm", f16, None): Differs(cuda_fp32("group_norm"), fp32),
    ("RMSNorm", f16, None): Differs(cuda_fp32("rms_norm"), fp32),
    **{(n, f16, None): Differs(cuda_fp32("softmax"), fp32) for n in ("Softmax", "Softmin", "Softmax2d")},
    ("LogSoftmax", f16, None): Differs(cuda_fp32("log_softmax"), fp32),
    ("Softplus", f16, None): Differs(cuda_fp32("softplus"), fp32),
    **{(n, f16, None): Differs(cuda_fp32("pow"), fp32) for n in ("LPPool1d", "LPPool2d")},
    **{(n, f16, None): Differs(cuda_fp32("upsampling"), fp32)
       for n in ("Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d")},
    ("MultiheadAttention", f16, None): Differs(cuda_fp32("softmax (the averaged attention weights)"),
                                               lambda half, given: [half, f32]),
    **{(n, f16, None): Differs(cpu_fp32(op), as_given) for n, op in (
        ("MaxPool3d", "max_pool3d"), ("AdaptiveAvgPool3d", "adaptive_avg_pool3d"),
        ("AdaptiveMaxPool3d", "adaptive_max_pool3d"), ("FractionalMaxPool2d", "fractional_max_pool2d"),
        ("FractionalMaxPool3d", "fractional_max_pool3d"), ("MaxUnpool1d", "max_unpool2d"),
        ("MaxUnpool2d", "max_unpool2d"), ("MaxUnpool3d", "max_unpool3d"), ("ReflectionPad1d", "reflection_pad1d"),
        ("ReflectionPad2d", "reflection_pad2d"), ("ReplicationPad1d", "replication_pad1d"),
        ("ReplicationPad2d", "replication_pad2d"), ("ReplicationPad3d", "replication_pad3d"))},
    ("GRU", f16, False): Differs(RNN_STATE, halves(2)),
    ("GRUCell", f16, False): Differs(RNN_STATE, halves(1)),
    ("LSTMCell", f16, False): Differs(RNN_STATE, halves(2)),
    ("LSTM", f16, False): Differs(RNN_STATE + "; its FP16 LSTM on an FP32 input fails in oneDNN", halves(3),
                                  autocast_fails=True),
    ("RReLU", f16, True): Differs("docs/guide.md, Parity (every layer): torch has no FP16 CPU kernel for rrelu, which "
                                  "amp_patch runs in FP32 on a CPU; CPU autocast has no policy for it and fails",
                                  fp32, autocast_fails=True),
    ("BCELoss", f16, None): Differs("docs/guide.md, Op lists: binary_cross_entropy is banned under FP16, as in CUDA "
                                    "autocast and apex.amp (CPU autocast runs it in FP32)", raises=BannedOpError),
    **{("Bilinear", h, True): Differs(PROMOTED.format(op="bilinear"), fp32, autocast_fails=True) for h in (f16, bf16)},
    **{("EmbeddingBag", h, True): Differs(PROMOTED.format(op="embedding_bag (per_sample_weights and weight)"), fp32,
                                          autocast_fails=True) for h in (f16, bf16)},
    **{("AdaptiveLogSoftmaxWithLoss", h, False): Differs(
        "torch's forward index_copy_s a head computed in half into an FP32 tensor (its input's dtype), which "
        "fails under autocast; docs/guide.md, In-place ops: amp_patch casts the source to the receiver's dtype",
        lambda half, given: [f32, f32], autocast_fails=True) for h in (f16, bf16)},
}


def difference(name: str, half: torch.dtype, fed: bool) -> Optional[Differs]:
    return DIFFERENCES.get((name, half, fed)) or DIFFERENCES.get((name, half, None))


def test_every_difference_names_a_layer_of_the_zoo():
    assert not {name for name, _, _ in DIFFERENCES} - set(LAYERS)


# ------------------------------------------------------------------ running a layer


class Fed(nn.Module):
    """``layer`` behind an identity ``nn.Linear`` on its first floating input
    (route b), or called directly (route a, ``width`` None)."""

    def __init__(self, layer: nn.Module, width: Optional[int]):
        super().__init__()
        self.layer = layer
        self.feed = None
        if width is not None:
            self.feed = nn.Linear(width, width)
            with torch.no_grad():
                self.feed.weight.copy_(torch.eye(width))
                self.feed.bias.zero_()

    def forward(self, *args):
        if self.feed is not None:
            i = _first_floating(args)
            args = args[:i] + (self.feed(args[i]),) + args[i + 1:]
        return self.layer(*args)


def seed(n: int) -> None:
    """``torch.manual_seed`` for the CPU generator alone: torch's own call also
    seeds every accelerator module, and records a stack trace for each, which
    costs milliseconds; this runs hundreds of times here."""
    torch.random.default_generator.manual_seed(n)


def _first_floating(args: tuple) -> Optional[int]:
    return next((i for i, a in enumerate(args) if _floating(a)), None)


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


@dataclasses.dataclass
class Result:
    """What one forward and backward gave: the floating outputs, the inputs'
    gradients, the parameters' gradients (the FP32 masters' under O2/O5)."""

    outputs: List[torch.Tensor]
    input_grads: List[Optional[torch.Tensor]]
    param_grads: List[Optional[torch.Tensor]]


def build(name: str, fed: bool, sized: bool = False) -> Tuple[nn.Module, tuple]:
    """The layer (behind the feed on route b) and its inputs, the same on every
    call. ``sized``: a lazy layer is first run once, so it has parameters to
    cast (O2/O5 refuse it before that, ``test_o2_refuses_a_lazy_module_before_its_first_forward``)."""
    spec = LAYERS[name]
    seed(0)
    layer = spec.make()
    inputs = spec.inputs()
    model = Fed(layer, inputs[_first_floating(inputs)].shape[-1] if fed else None).train()
    if sized and isinstance(layer, nn.modules.lazy.LazyModuleMixin):
        with torch.no_grad():
            model(*inputs)
    return model, inputs


def forward_backward(name: str, model: nn.Module, inputs: tuple, grads_of: Optional[list] = None) -> Result:
    """One forward, then the backward of a fixed random projection of every
    floating output (so no gradient is a plain sum's: a softmax's would be 0)."""
    wrt = LAYERS[name].wrt
    inputs = tuple(a.detach().clone().requires_grad_() if _floating(a) and (wrt is None or i in wrt) else a
                   for i, a in enumerate(inputs))
    seed(1)  # dropout masks, RReLU slopes, fractional pooling: the same draws in every run
    out = model(*inputs)
    outputs = [t for t in tree_leaves(out) if _floating(t)]
    weights = torch.Generator().manual_seed(2)
    total = sum((t.float() * torch.randn(t.shape, generator=weights)).sum() for t in outputs)
    total.backward()
    params = grads_of if grads_of is not None else list(model.parameters())
    return Result([t.detach() for t in outputs], [a.grad for a in inputs if _floating(a) and a.requires_grad],
                  [p.grad for p in params])


def under_autocast(name: str, fed: bool, half: torch.dtype) -> Result:
    model, inputs = build(name, fed)
    with torch.autocast("cpu", dtype=half):
        return forward_backward(name, model, inputs)


def in_fp32(name: str, fed: bool, sized: bool = False) -> Result:
    model, inputs = build(name, fed, sized)
    return forward_backward(name, model, inputs)


def under_amp(name: str, level: str, half: torch.dtype, routes: List[bool]) -> Dict[bool, Optional[Result]]:
    """The layer on each route under one amp_patch session at ``level``, with a
    loss scale of 1: the zoo compares what is cast (the loss scaler has tests of
    its own). A route where amp_patch refuses the layer by design
    (``Differs.raises``) is checked to raise, and gives None."""
    function_level = level in FUNCTION_LEVELS
    built = {fed: build(name, fed, sized=not function_level) for fed in routes}
    optimizers = {}
    if function_level:
        session = amp(None, None, level, half_dtype=half, loss_scale=1.0)
    else:
        optimizers = {fed: torch.optim.SGD(model.parameters(), lr=0.1) for fed, (model, _) in built.items()}
        session = amp([built[fed][0] for fed in routes], [optimizers[fed] for fed in routes], level,
                      half_dtype=half, loss_scale=1.0)
    results: Dict[bool, Optional[Result]] = {}
    with session:
        for fed, (model, inputs) in built.items():
            # the FP32 masters' gradients at O2/O5 (the half model's .grad is None there)
            params = None if function_level else list(amp_patch.master_params(optimizers[fed]))
            differs = difference(name, half, fed) if function_level else None
            if differs is not None and differs.raises is not None:
                with pytest.raises(differs.raises):
                    forward_backward(name, model, inputs)
                results[fed] = None
            else:
                results[fed] = forward_backward(name, model, inputs, params)
    return results


# ------------------------------------------------------------------ comparing


#: relative error (Frobenius norm) allowed against autocast, by half dtype: the
#: same ops in the same dtypes agree to rounding
AUTOCAST_TOL = {bf16: 2 ** -6, f16: 2 ** -9}
#: against FP32, for a layer computed in the half dtype (a 2-layer ReLU RNN in
#: BF16 is 9 % off FP32 in its input's gradient, in plain torch too)
FP32_TOL = {bf16: 2 ** -3, f16: 2 ** -6}


def assert_close(got: List[Optional[torch.Tensor]], want: List[Optional[torch.Tensor]], tol: float, what: str) -> None:
    """Each tensor within ``tol`` of the reference, relative to its norm; a
    reference near 0 (a bias gradient in front of a normalization) is held to
    ``tol`` per element instead."""
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what} {i}: {'None' if g is None else 'a tensor'}, expected {w}"
        if g is None:
            continue
        assert g.shape == w.shape, f"{what} {i}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        g64, w64 = g.double(), w.double()
        assert torch.isfinite(g64).all() and torch.isfinite(w64).all(), f"{what} {i}: non-finite values"
        err, scale = (g64 - w64).norm().item(), w64.norm().item()
        assert err <= tol * max(scale, g64.numel() ** 0.5), f"{what} {i}: error {err:.3g} on a norm of {scale:.3g}"


def dtypes(ts: List[Optional[torch.Tensor]]) -> List[Optional[torch.dtype]]:
    return [None if t is None else t.dtype for t in ts]


LEVELS = [("O1", f16), ("O4", bf16), ("O2", f16), ("O5", bf16)]
FUNCTION_LEVELS = ("O1", "O4")
ROUTE = {False: "FP32 input", True: "fed by a half-producing Linear"}


def routes(name: str, level: str) -> List[bool]:
    """The routes a layer runs on at ``level`` (False: a, True: b).

    A layer with integer inputs only (Embedding) has no route b; O2/O5 refuse a
    model with no floating parameters (nothing to cast), so a parameterless
    layer runs there on route b only, behind the Linear, as it would in a model.
    """
    spec = LAYERS[name]
    seed(0)
    with warnings.catch_warnings():  # deprecated layers warn when built
        warnings.simplefilter("ignore")
        has_params = any(True for _ in spec.make().parameters())
    out = [False] if level in FUNCTION_LEVELS or has_params else []
    return out + [True] if _first_floating(spec.inputs()) is not None else out


@pytest.fixture(scope="module", autouse=True)
def default_lists_parsed_once():
    """Parse the shipped op lists once for this module, not at every initialize
    (about 0.15 s each, hundreds of times here)."""
    real = oplists.load
    defaults = real()

    def load(lists=None):
        if lists is None and not os.environ.get(oplists.ENV_VAR, "").strip():
            return defaults
        return real(lists)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oplists, "load", load)
        yield


@pytest.mark.parametrize("level,half", LEVELS, ids=[lv for lv, _ in LEVELS])
@pytest.mark.parametrize("name", CLASSES)
def test_layer(name, level, half):
    """One layer at one level, on each route: see the module's docstring."""
    if name not in LAYERS:
        pytest.fail(f"torch.nn.{name} has no entry in LAYERS (constructor arguments and inputs) "
                    f"or EXCLUDED (with the reason)")
    for fed, got in under_amp(name, level, half, routes(name, level)).items():
        if got is not None:
            check(name, level, half, fed, got)


def check(name: str, level: str, half: torch.dtype, fed: bool, got: Result) -> None:
    """``got`` (one route's run under amp_patch) against its reference."""
    where = f"{name} at {level}, {ROUTE[fed]}"
    differs = difference(name, half, fed)
    if level not in FUNCTION_LEVELS:
        want = in_fp32(name, fed, sized=True)
        assert dtypes(got.outputs) == [f32] * len(want.outputs), f"{where}: O2/O5 return FP32 outputs"
        assert all(g is None or g.dtype == f32 for g in got.param_grads), f"{where}: FP32 masters' gradients"
        tol = FP32_TOL[half]
    elif differs is None:
        want = under_autocast(name, fed, half)
        assert dtypes(got.outputs) == dtypes(want.outputs), f"{where}: output dtypes differ from autocast's"
        assert dtypes(got.param_grads) == dtypes(want.param_grads), f"{where}: gradient dtypes differ from autocast's"
        tol = AUTOCAST_TOL[half]
    else:
        if differs.autocast_fails:
            with pytest.raises(RuntimeError):
                under_autocast(name, fed, half)
        want = in_fp32(name, fed)
        assert dtypes(got.outputs) == differs.outputs(half, half if fed else f32), f"{where}: {differs.why}"
        assert dtypes(got.param_grads) == dtypes(want.param_grads), f"{where}: gradient dtypes"
        tol = FP32_TOL[half]
    assert dtypes(got.input_grads) == dtypes(want.input_grads), f"{where}: input gradient dtypes"
    assert_close(got.outputs, want.outputs, tol, f"{where}: output")
    assert_close(got.input_grads, want.input_grads, tol, f"{where}: input gradient")
    assert_close(got.param_grads, want.param_grads, tol, f"{where}: parameter gradient")


# ------------------------------------------------------------------ O2/O5 and what torch cannot run in half


@pytest.mark.parametrize("cls,lacking", model_side._NO_HALF_CPU_KERNEL, ids=lambda v: getattr(v, "__name__", ""))
def test_layers_kept_fp32_at_o2_on_a_cpu_have_no_half_kernel_there(cls, lacking):
    """O2/O5 keep these layers FP32 in a CPU model (their runs above pass)
    because torch cannot run them in those half dtypes on a CPU; once a torch
    release can, this fails and the entry should go."""
    for half in lacking:
        model, inputs = build(cls.__name__, False)
        inputs = tuple(a.to(half) if _floating(a) else a for a in inputs)
        with pytest.raises(NotImplementedError, match="not implemented for"):
            model.to(half)(*inputs)


def test_o2_refuses_a_lazy_module_before_its_first_forward():
    """A lazy module's parameters do not exist before its first forward pass:
    O2/O5 say so, and change nothing. After a forward pass it runs (above)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"LazyLinear '1' is a lazy module.*Run one forward pass"):
        amp_patch.initialize(model, optimizer, opt_level="O5", verbosity=0)
    assert not amp_patch.is_initialized()
    assert model[0].weight.dtype == f32 and not model._forward_pre_hooks
    model(torch.randn(2, 4))
    with amp(model, optimizer, "O5"):
        assert model(torch.randn(2, 4)).dtype == f32 and model[1].weight.dtype == bf16


# ------------------------------------------------------------------ parametrized layers

PARAMETRIZATIONS = {
    "orthogonal": nn.utils.parametrizations.orthogonal,
    "weight_norm": nn.utils.parametrizations.weight_norm,
    "spectral_norm": nn.utils.parametrizations.spectral_norm,
}


#: how far a loss over six steps may drift from FP32's (what the runs give: under 3e-3 in BF16)
LOSS_TOL = {bf16: 2e-2, f16: 5e-3}


def _parametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(PARAMETRIZATIONS[kind](nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> List[float]:
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level,half", [("O2", f16), ("O5", bf16)])
@pytest.mark.parametrize("kind", sorted(PARAMETRIZATIONS))
def test_a_parametrization_computes_its_weight_in_fp32_at_o2(kind, level, half):
    """``nn.utils.parametrizations`` layers at O2/O5: the parametrization stays
    FP32 with the batchnorms (its originals are their own masters) and the
    weight it computes joins the half layer in the half dtype. In half,
    ``orthogonal``'s ``torch.matrix_exp`` turns the weight to NaN after one step."""
    steps = 6
    ref = _parametrized(kind)
    want = _train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), steps)
    model = _parametrized(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with amp(model, optimizer, level, half_dtype=half, loss_scale=128.0):
        plist = model[0].parametrizations.weight
        assert all(p.dtype == f32 for p in plist.parameters())
        assert model[0].bias.dtype == half and model[2].weight.dtype == half
        assert model[0].weight.dtype == half  # what F.linear reads
        got = _train(model, optimizer, steps)
        assert all(math.isfinite(v) for v in got), got
        assert max(abs(a - b) for a, b in zip(got, want)) < LOSS_TOL[half], (got, want)
        saved = model.state_dict()
        assert set(saved) == set(ref.state_dict()) and all(v.dtype == f32 for v in saved.values())
    assert all(p.dtype == f32 for p in model.parameters())


@pytest.mark.parametrize("kind", sorted(PARAMETRIZATIONS))
def test_a_pure_half_model_keeps_its_parametrizations_in_half(kind):
    """O3 (and O2 with ``keep_batchnorm_fp32=False``) cast everything, the
    parametrizations' originals included, as ``model.half()`` does."""
    for level, extra in (("O3", {}), ("O2", {"keep_batchnorm_fp32": False})):
        model = _parametrized(kind)
        with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), level, half_dtype=bf16, **extra):
            assert all(p.dtype == bf16 for p in model[0].parametrizations.weight.parameters()), level
