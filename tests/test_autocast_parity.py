"""Whole models under amp_patch O4 against ``torch.autocast("cpu", dtype=torch.bfloat16)``.

The op-by-op tests (test_ops_generated.py) compare each listed op with
autocast's policy for it. Here whole forward passes are compared, as a user
would run them: tiny random-config Hugging Face models (built from configs,
nothing downloaded) and torch.nn building blocks. For each training case:

* every aten op of the forward is recorded with a ``TorchDispatchMode`` under
  autocast and under amp_patch; the compute ops (neither a view nor a dtype
  conversion) must be the same ops in the same order with the same output
  dtypes;
* amp_patch's dtype conversions (``aten._to_copy`` between FP32, FP16 and
  BF16) number no more than autocast's;
* the loss and every parameter's gradient are bit-for-bit equal (these runs
  are made without the recording mode, which changes how autocast treats the
  ops inside a fused kernel).

Inference fast paths (eval under ``no_grad``) are compared by their outputs.
Where torch itself fails under autocast the test says so and checks amp_patch
against the documented expectation instead.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import amp_patch
from helpers import amp

bf16, f32 = torch.bfloat16, torch.float32
CASTABLE = (torch.float16, bf16, f32)
TO_COPY = torch.ops.aten._to_copy.default

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]


class Trace(TorchDispatchMode):
    """The forward's compute ops with their output dtypes, and the casts made."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[str, Tuple[str, ...]]] = []
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is TO_COPY:
            src, dst = args[0].dtype, out.dtype
            self.casts += src != dst and src in CASTABLE and dst in CASTABLE
        elif not func.is_view:
            dtypes = tuple(str(t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.ops.append((func.name(), dtypes))
        return out


Case = Callable[[], Tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]


def _ids(*shape: int, high: int = 64) -> torch.Tensor:
    return torch.randint(0, high, shape)


def _hf(model_cls, config, inputs: Callable[[], dict]):
    config._attn_implementation = "sdpa"
    model = model_cls(config).train()
    batch = inputs()
    return model, lambda m: m(**batch).loss


def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return _hf(transformers.BertForSequenceClassification, cfg,
               lambda: {"input_ids": _ids(2, 8), "attention_mask": mask, "labels": torch.tensor([0, 2])})


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    ids = _ids(2, 8)
    return _hf(transformers.GPT2LMHeadModel, cfg, lambda: {"input_ids": ids, "labels": ids})


def t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return _hf(transformers.T5ForConditionalGeneration, cfg,
               lambda: {"input_ids": _ids(2, 8), "labels": _ids(2, 6)})


def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    ids = _ids(2, 8)
    return _hf(transformers.LlamaForCausalLM, cfg, lambda: {"input_ids": ids, "labels": ids})


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, num_labels=3)
    return _hf(transformers.ViTForImageClassification, cfg,
               lambda: {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([1, 2])})


def clip():
    # the contrastive loss scales BF16 logits by logit_scale.exp(), a 0-dim FP32 tensor
    cfg = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"image_size": 16, "patch_size": 4, "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2},
        projection_dim=16,
    )
    return _hf(transformers.CLIPModel, cfg, lambda: {"input_ids": _ids(2, 8), "pixel_values": torch.randn(2, 3, 16, 16),
                                                     "return_loss": True})


def _regression(model: nn.Module, *inputs, out=lambda y: y):
    target = out(model(*inputs)).detach().float().clone().normal_()
    return model, lambda m: F.mse_loss(out(m(*inputs)), target)


def _encoder(nested: bool = False) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)


PADDING = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])


def encoder_train():
    return _regression(_encoder().train(), torch.randn(2, 6, 16))


def encoder_train_masked():
    model, x = _encoder().train(), torch.randn(2, 6, 16)
    target = torch.randn(2, 6, 16)
    return model, lambda m: F.mse_loss(m(x, src_key_padding_mask=PADDING), target)


def lstm():
    return _regression(nn.LSTM(8, 12, num_layers=2, batch_first=True), torch.randn(3, 10, 8), out=lambda y: y[0])


def gru():
    model = nn.GRU(8, 12, num_layers=2)
    x, h0 = torch.randn(10, 3, 8), torch.randn(2, 3, 12)
    target = torch.randn(10, 3, 12)
    return model, lambda m: F.mse_loss(m(x, h0)[0], target)


def conv_bn_reflect():
    model = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.ReplicationPad2d(1), nn.Conv2d(8, 4, 3), nn.ZeroPad2d(1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten()).train()
    return _regression(model, torch.randn(2, 3, 8, 8))


def embedding_bag():
    model = nn.Sequential(nn.EmbeddingBag(20, 16, mode="mean"), nn.Linear(16, 3))
    ids, labels = torch.randint(0, 20, (4, 5)), torch.tensor([0, 1, 2, 1])
    return model, lambda m: F.cross_entropy(m(ids), labels)


TRAINING: List[Case] = [bert, gpt2, t5, llama, vit, clip, encoder_train, encoder_train_masked, lstm, gru,
                        conv_bn_reflect, embedding_bag]


def _under_autocast(model: nn.Module, loss_fn, trace: Trace = None) -> torch.Tensor:
    with torch.autocast("cpu", dtype=bf16):
        if trace is None:
            return loss_fn(model)
        with trace:
            return loss_fn(model)


def _under_amp(model: nn.Module, loss_fn, trace: Trace = None) -> torch.Tensor:
    with amp(None, None, "O4"):
        if trace is None:
            loss = loss_fn(model)
        else:
            with trace:
                loss = loss_fn(model)
        loss.backward()
    return loss


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: autocast ran {x}, amp_patch ran {y} (after {a[max(0, i - 3):i]})"
    return f"autocast ran {len(a)} compute ops, amp_patch {len(b)}; the longer goes on with {(a + b)[min(len(a), len(b))]}"


@pytest.mark.parametrize("case", TRAINING, ids=[c.__name__ for c in TRAINING])
def test_a_training_forward_runs_as_under_autocast(case):
    torch.manual_seed(0)
    model, loss_fn = case()
    by_autocast, by_amp = copy.deepcopy(model), copy.deepcopy(model)

    seen_autocast, seen_amp = Trace(), Trace()
    _under_autocast(copy.deepcopy(model), loss_fn, seen_autocast)
    _under_amp(copy.deepcopy(model), loss_fn, seen_amp)
    assert seen_autocast.ops == seen_amp.ops, _first_difference(seen_autocast.ops, seen_amp.ops)
    assert any("torch.bfloat16" in d for _, d in seen_amp.ops), "nothing ran in BF16"
    assert seen_amp.casts <= seen_autocast.casts, (
        f"amp_patch cast {seen_amp.casts} tensors, autocast {seen_autocast.casts}")

    want = _under_autocast(by_autocast, loss_fn)
    want.backward()
    got = _under_amp(by_amp, loss_fn)
    assert got.dtype == want.dtype and torch.equal(got, want), f"loss {got} under amp_patch, {want} under autocast"
    for (name, p), q in zip(by_amp.named_parameters(), by_autocast.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{name}: gradients differ by {(p.grad - q.grad).abs().max():.3g}"


# ------------------------------------------------------------------ inference fast paths


def _mha():
    return nn.MultiheadAttention(16, 2, batch_first=True).eval()


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_multihead_attention_eval_takes_the_fast_path_in_bf16(masked):
    """nn.MultiheadAttention in eval under no_grad calls the fused
    ``torch._native_multi_head_attention``; CPU autocast runs it in BF16, and so
    does amp_patch, with torch's autocast state left as it is (the fast path
    checks ``torch.is_autocast_enabled()``)."""
    torch.manual_seed(0)
    mha, q = _mha(), torch.randn(2, 6, 16)
    mask = PADDING if masked else None
    with torch.no_grad():
        with torch.autocast("cpu", dtype=bf16):
            want = mha(q, q, q, key_padding_mask=mask, need_weights=False)[0]
        trace = Trace()
        with amp(None, None, "O4"):
            assert not torch.is_autocast_enabled() and not torch.is_autocast_enabled("cpu")
            with trace:
                got = mha(q, q, q, key_padding_mask=mask, need_weights=False)[0]
    assert ("aten::_native_multi_head_attention", ("torch.bfloat16",)) in trace.ops
    assert got.dtype == want.dtype == bf16
    assert torch.equal(got, want)


def test_transformer_encoder_eval_runs_in_bf16():
    """The encoder's fused inference kernel runs in BF16 under both (autocast
    casts the matmuls inside it, amp_patch its inputs)."""
    torch.manual_seed(0)
    enc, x = _encoder().eval(), torch.randn(2, 6, 16)
    with torch.no_grad():
        reference = enc(x)
        with torch.autocast("cpu", dtype=bf16):
            want = enc(x)
        trace = Trace()
        with amp(None, None, "O4"), trace:
            got = enc(x)
    assert [op for op, _ in trace.ops].count("aten::_transformer_encoder_layer_fwd") == 2
    assert got.dtype == want.dtype == bf16
    # Not bit for bit: autocast hands the fused kernel FP32 norm weights, amp_patch BF16 ones.
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    torch.testing.assert_close(got.float(), reference, atol=0.1, rtol=0.1)


def test_transformer_encoder_eval_with_a_padding_mask_runs_in_bf16_where_autocast_fails():
    """With a padding mask the fast path packs the batch into a nested tensor.
    Under CPU BF16 autocast torch 2.13 fails there ("expected scalar type Float
    but found BFloat16"); the documented expectation is what it does without
    the mask: the layers run in BF16, padded positions come out zero, the rest
    matches FP32 to BF16 precision. amp_patch does that."""
    torch.manual_seed(0)
    enc, x = _encoder(nested=True).eval(), torch.randn(2, 6, 16)
    with torch.no_grad():
        reference = enc(x, src_key_padding_mask=PADDING)
        with torch.autocast("cpu", dtype=bf16), pytest.raises(RuntimeError, match="expected scalar type"):
            enc(x, src_key_padding_mask=PADDING)
        trace = Trace()
        with amp(None, None, "O4"), trace:
            got = enc(x, src_key_padding_mask=PADDING)
    assert [op for op, _ in trace.ops].count("aten::_transformer_encoder_layer_fwd") == 2
    assert got.dtype == bf16
    assert torch.equal(got[1, 4:], torch.zeros_like(got[1, 4:])) and torch.equal(reference[1, 4:], got[1, 4:].float())
    torch.testing.assert_close(got.float(), reference, atol=0.1, rtol=0.1)


# ------------------------------------------------------------------ the rules behind the parity, op by op


def _o4_stats():
    return amp(None, None, "O4", collect_stats=True)


def test_promote_ops_follow_torchs_promotion_of_zero_dim_tensors_and_scalars():
    """A 0-dim FP32 tensor or a Python scalar does not widen a dimensioned BF16
    tensor (``torch.result_type``), for the operators as for ``torch.mul``; a
    real mix of dimensioned tensors still runs in FP32."""
    torch.manual_seed(0)
    y, s, w = torch.randn(4, 3).to(bf16), torch.tensor(1.5), torch.randn(4, 3)
    idx = torch.tensor([0, 2])
    calls = {
        "y * s": lambda: y * s, "s * y": lambda: s * y, "y + s": lambda: y + s, "y - s": lambda: y - s,
        "y / s": lambda: y / s, "y * 2.0": lambda: y * 2.0, "addcmul(y, y, s)": lambda: torch.addcmul(y, y, s),
        "y + w": lambda: y + w, "atan2(y, w)": lambda: torch.atan2(y, w),
    }
    want = {k: fn() for k, fn in calls.items()}
    # ops that refuse mixed dtypes are cast to the promoted dtype: BF16 here, FP32 for a real mix
    want["index_put(y, s)"] = torch.index_put(y, (idx,), s.to(bf16))
    want["dot(y, w)"] = torch.dot(y[0].float(), w[0])
    calls["index_put(y, s)"] = lambda: torch.index_put(y, (idx,), s)
    calls["dot(y, w)"] = lambda: torch.dot(y[0], w[0])
    with amp(None, None, "O4"):
        got = {k: fn() for k, fn in calls.items()}
    for k in calls:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{k}: {got[k].dtype} vs {want[k].dtype}"
    assert got["y * s"].dtype == bf16 and got["y + w"].dtype == f32 and got["dot(y, w)"].dtype == f32


def test_ops_whose_kernels_promote_are_not_cast_and_the_ledger_shows_it():
    """Residual adds and rotary ``q * cos`` (BF16 with FP32) run as torch runs
    them, with no FP32 copy of the BF16 operand: same bits, no cast in the
    ledger. ``torch.dot``, whose kernel refuses mixed dtypes, still casts."""
    torch.manual_seed(0)
    h, f = torch.randn(4, 3).to(bf16), torch.randn(4, 3)
    calls = {
        "torch.Tensor.__add__": lambda: h + f, "torch.Tensor.__mul__": lambda: h * f,
        "torch.Tensor.__radd__": lambda: f.__radd__(h), "torch.Tensor.__truediv__": lambda: f / h,
        "torch.cat": lambda: torch.cat([h, f]), "torch.addcmul": lambda: torch.addcmul(f, h, h),
    }
    want = {k: fn() for k, fn in calls.items()}
    with _o4_stats():
        got = {k: fn() for k, fn in calls.items()}
        torch.dot(h[0], f[0])
        ops = amp_patch.report().to_dict()["ops"]
    for k in calls:
        assert got[k].dtype == f32 and torch.equal(got[k], want[k]), k
        assert ops[k]["calls"] == 1 and ops[k]["casts"] == 0, f"{k}: {ops[k]}"
    assert ops["torch.dot"]["casts"] == 1


@pytest.mark.parametrize("cell,state", [(nn.GRUCell, f32), (nn.LSTMCell, f32), (nn.GRU, f32), (nn.RNNCell, bf16),
                                        (nn.RNN, bf16)], ids=lambda c: getattr(c, "__name__", str(c)))
def test_recurrent_state_runs_on_cpu_as_under_autocast(cell, state):
    """CPU autocast casts the RNN's matmuls, not its FP32 hidden state: GRU's
    and the LSTM cell's state stays FP32 (a plain RNN's is the tanh of BF16
    matmuls, so BF16); so does amp_patch on CPU (a BF16 GRU state changed
    gradients by about 0.5 % on a short sequence, more on longer ones)."""
    torch.manual_seed(0)
    model = cell(6, 5)
    x = torch.randn(7, 3, 6) if cell in (nn.GRU, nn.RNN) else torch.randn(3, 6)
    by_amp = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=bf16):
        want = model(x)
    with amp(None, None, "O4"):
        got = by_amp(x)
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        assert g.dtype == w.dtype == state and torch.equal(g, w)
    sum(t.sum() for t in tree_leaves(want)).backward()
    sum(t.sum() for t in tree_leaves(got)).backward()
    for p, q in zip(by_amp.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("pad,mode,dtype", [
    ((1, 1, 2, 1), "reflect", f32), ((1, 2), "reflect", f32), ((1, 1, 1, 1, 1, 1), "reflect", bf16),
    ((1, 1, 2, 1), "replicate", f32), ((1, 1, 1, 1, 1, 1), "replicate", f32),
    ((1, 1, 2, 1), "constant", bf16), ((1, 1, 2, 1), "circular", bf16),
], ids=lambda v: str(v))
def test_padding_runs_as_under_cpu_autocast(pad, mode, dtype):
    """reflection_pad1d/2d and replication_pad* are FP32 under CPU autocast;
    constant, circular and 3-D reflection padding keep the input's dtype."""
    x = torch.randn(1, 2, 4, 4, 4).to(bf16)
    x = x[0] if len(pad) == 4 else x[0, 0] if len(pad) == 2 else x
    with torch.autocast("cpu", dtype=bf16):
        want = F.pad(x, pad, mode)
    with amp(None, None, "O4"):
        got = F.pad(x, pad, mode)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_checkpoint_recomputes_as_the_forward_ran():
    """``torch.utils.checkpoint`` re-enters autocast at recompute only if
    ``torch.is_autocast_enabled`` said so in the forward; amp_patch leaves that
    False, so the recompute runs under the same casts: same loss and gradients
    as without checkpointing."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8)), torch.randn(4, 8)
    plain = copy.deepcopy(model)
    with amp(None, None, "O4"):
        assert not torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        got = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum()
        got.backward()
        want = plain(x).sum()
        want.backward()
    assert torch.equal(got, want)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
