"""The benchmark workloads and the precision modes they run under.

Every workload is built from one seed, so every mode trains the same initial
weights on the same data. A mode turns a fresh copy of the model into a
``step()`` callable that runs one training step and returns the loss tensor.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.precision import onepass


@dataclasses.dataclass
class Workload:
    name: str
    model: nn.Module
    batches: List[tuple]
    loss_fn: Callable
    flops_per_step: float  # matmul FLOPs of forward + backward, for MFU
    lr: float = 1e-3
    momentum: float = 0.9  # of the SGD optimizer every mode trains with


class SimpleNet(nn.Module):
    """The Paddle AMP tutorial's network: three Linear layers, ReLU between."""

    def __init__(self, width: int):
        super().__init__()
        self.linear1 = nn.Linear(width, width)
        self.linear2 = nn.Linear(width, width)
        self.linear3 = nn.Linear(width, width)

    def forward(self, x):
        return self.linear3(F.relu(self.linear2(F.relu(self.linear1(x)))))


class ConvNet(nn.Module):
    """A small ResNet-style conv net with BatchNorm."""

    def __init__(self, channels: int = 64, classes: int = 10):
        super().__init__()
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
        )
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        x = self.down(x)
        return self.head(x.mean((2, 3)))


class SmallOps(nn.Module):
    """Overhead-bound: many tiny Linear + LayerNorm + GELU blocks."""

    def __init__(self, width: int = 64, blocks: int = 12):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(blocks))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


class Encoder(nn.Module):
    def __init__(self, d_model=512, heads=8, layers=4, vocab=1000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class GPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm causal
    self-attention blocks, a tied output head."""

    def __init__(self, d_model=1024, heads=16, layers=8, vocab=8192, seq=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, c_mid: int, stride: int = 1):
        super().__init__()
        c_out = 4 * c_mid
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_mid, 1, bias=False), nn.BatchNorm2d(c_mid), nn.ReLU(inplace=True),
            nn.Conv2d(c_mid, c_mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_mid), nn.ReLU(inplace=True),
            nn.Conv2d(c_mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out),
        )
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """A ResNet-50-style net of bottleneck blocks (fewer blocks per stage)."""

    def __init__(self, width: int = 64, blocks=(2, 2, 2, 2), classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, c_in = [], width
        for i, n in enumerate(blocks):
            mid = width * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(c_in, mid, stride=2 if j == 0 and i > 0 else 1))
                c_in = 4 * mid
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def _conv_flops(model: nn.Module, x: torch.Tensor) -> float:
    """Multiply-add FLOPs of every Conv2d and Linear for one forward of ``x`` (x2 for forward, x3 with backward)."""
    total = [0.0]

    def hook(mod, inp, out):
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            total[0] += 2 * out.numel() * k
        elif isinstance(mod, nn.Linear):
            total[0] += 2 * out.numel() * mod.in_features

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model.eval()
        model(x[:1])
        model.train()
    for h in hs:
        h.remove()
    return 3 * total[0] * x.shape[0]


def build(name: str, gpu: bool = False, scale: float = 1.0, nbatches: int = 4) -> Workload:
    """One of: simplenet, transformer, convnet, smallops; gpt and resnet (GPU sizes)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "simplenet":
        width, batch = (4096, 512) if gpu else (int(2048 * scale), int(256 * scale) or 8)
        model = SimpleNet(width)
        batches = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(nbatches)]
        # the tutorial's optimizer: paddle.optimizer.SGD(learning_rate=0.0001), no momentum
        return Workload(name, model, batches, F.mse_loss, 3 * 6 * batch * width * width, lr=1e-4, momentum=0.0)
    if name == "transformer":
        d, seq, batch, vocab = int(512 * scale) or 64, 128, 8, 1000
        model = Encoder(d_model=d, vocab=vocab)
        batches = [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(nbatches)]
        tokens = batch * seq
        per_layer = 4 * d * d + 2 * d * 4 * d  # qkv+out projections, MLP
        attn = 2 * seq * d  # scores and weighted sum per token
        flops = 6 * tokens * (4 * (per_layer + attn) + d * vocab)

        def ce(out, tgt):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

        return Workload(name, model, batches, ce, flops)
    if name == "convnet":
        batch, c, hw = 32, int(64 * scale) or 8, 32
        model = ConvNet(c)
        batches = [(torch.randn(batch, 3, hw, hw, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(nbatches)]
        convs = (3 * c + 2 * c * c) * 9 * hw * hw + (c * 2 * c) * 9 * (hw // 2) ** 2
        return Workload(name, model, batches, F.cross_entropy, 6 * batch * convs)
    if name == "smallops":
        model = SmallOps()
        batches = [(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g)) for _ in range(nbatches)]
        return Workload(name, model, batches, F.mse_loss, 6 * 32 * (12 * 64 * 64 + 64))
    if name == "gpt":
        d, layers, seq, batch, vocab = (1024, 8, 512, 16, 8192) if gpu else (int(256 * scale) or 64, 2, 64, 4, 1000)
        model = GPT(d_model=d, heads=max(1, d // 64), layers=layers, vocab=vocab, seq=seq)
        batches = [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(nbatches)]
        tokens = batch * seq
        flops = 6 * tokens * (layers * (12 * d * d + 2 * seq * d) + d * vocab)

        def ce(out, tgt):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

        return Workload(name, model, batches, ce, flops, lr=1e-4)
    if name == "resnet":
        batch, hw, width = (256, 160, 64) if gpu else (4, 64, int(16 * scale) or 8)
        model = ResNet(width)
        batches = [(torch.randn(batch, 3, hw, hw, generator=g), torch.randint(0, 1000, (batch,), generator=g)) for _ in range(nbatches)]
        return Workload(name, model, batches, F.cross_entropy, _conv_flops(model, batches[0][0]), lr=0.01)
    raise ValueError(f"unknown workload {name!r}; use simplenet, transformer, convnet, smallops, gpt or resnet")


MODES = ("fp32", "autocast", "O1", "O1-auto", "O1-synced", "O2", "O2-absorb", "O2-parity", "O2-plain", "O2-fused",
         "O2-synced", "O2-fusedopt", "O3")
#: the amp_patch modes: opt level and extra ``initialize`` options. O2 is the default
#: (the one-pass C step where it is built); O2-plain leaves that kernel out, as where
#: no compiler was at install (O2 before the one-pass step); O2-fused is fused_update=True;
#: O1-auto is O1 with cast_policy="auto" (small matmuls stay FP32); O2-parity is O2
#: with cast_policy="parity" (attention in the half dtype, as before O2's default became "auto");
#: O2-absorb is model_grads=False (half gradients move into the masters as they arrive, the
#: model's .grad stays None: the backward's peak memory without the half gradients).
#: O1-synced and O2-synced are sync_free=False (the skip decision read on the host, one
#: sync a step, against the default's none); O2-fusedopt gives torch's SGD fused=True,
#: whose step takes the verdict as found_inf (the sync-free step on CUDA).
#: the modes a suite run leaves out unless named (--modes): the host-decided step, torch's fused SGD
OPT_IN_MODES = ("O1-synced", "O2-synced", "O2-fusedopt")
#: NVIDIA Apex's own apex.amp, where an Apex checkout is importable (``PYTHONPATH``)
APEX_MODES = ("apex-O1", "apex-O2")
AMP_MODES = {"O1": ("O1", {}), "O1-auto": ("O1", {"cast_policy": "auto"}), "O2": ("O2", {}), "O2-parity": ("O2", {"cast_policy": "parity"}), "O2-plain": ("O2", {}), "O2-fused": ("O2", {"fused_update": True}),
             "O2-absorb": ("O2", {"model_grads": False}), "O3": ("O3", {}),
             "O1-synced": ("O1", {"sync_free": False}), "O2-synced": ("O2", {"sync_free": False}),
             "O2-fusedopt": ("O2", {})}


class Runner:
    """One workload under one mode: a model copy, its optimizer, ``step()``."""

    def __init__(self, wl: Workload, mode: str, device: str, half: torch.dtype, copy_model: bool = True):
        self.mode, self.device, self.half = mode, device, half
        # a worker process that owns its workload trains wl.model itself, so
        # its peak memory holds one model, not two
        self.model = (copy.deepcopy(wl.model) if copy_model else wl.model).to(device)
        self.batches = [tuple(t.to(device) for t in b) for b in wl.batches]
        self.loss_fn = wl.loss_fn
        self.opt = torch.optim.SGD(self.model.parameters(), lr=wl.lr, momentum=wl.momentum,
                                   fused=True if mode == "O2-fusedopt" else None)
        self.i = 0
        self.scaler: Optional[torch.amp.GradScaler] = None
        if mode == "autocast" and device == "cuda" and half == torch.float16:
            self.scaler = torch.amp.GradScaler("cuda")
        self.apex = None
        if mode in APEX_MODES:
            # the real apex.amp (needs CUDA); only in a worker of its own, as amp_patch's
            from apex import amp as apex_amp

            self.apex = apex_amp
            self.model, self.opt = apex_amp.initialize(self.model, self.opt, opt_level=mode[5:], verbosity=0)
        if mode in AMP_MODES:
            # amp_patch's state is per process: the suite runs each mode in its own.
            level, extra = AMP_MODES[mode]
            if mode in ("O2-plain", "O2-fused"):
                onepass.native = None  # this worker process only ever runs this mode
            self.model, self.opt = amp_patch.initialize(self.model, self.opt, level, half_dtype=half, verbosity=0, **extra)

    def step(self) -> torch.Tensor:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        if self.apex is not None:
            self.opt.zero_grad()  # Apex's O2 zero_grad takes no set_to_none
        else:
            self.opt.zero_grad(set_to_none=True)
        if self.mode == "autocast":
            with torch.autocast(self.device, dtype=self.half):
                loss = self.loss_fn(self.model(x), y)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                self.opt.step()
            return loss
        loss = self.loss_fn(self.model(x), y)
        if self.apex is not None:
            with self.apex.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        self.opt.step()
        return loss
