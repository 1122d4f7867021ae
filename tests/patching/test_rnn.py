"""nn.RNN, nn.GRU, nn.LSTM and the cells at O1/O4, against ``torch.autocast``.

The RNN kernels are on the ``half`` list; ``nn.RNNBase.forward`` refuses an
input whose dtype is not the weights' unless autocast is on, so amp_patch
skips that part of its check while a session casts the kernels
(``amp_patch/patching/rnn.py``). Each layer runs fed an FP32 input, and fed by
an ``nn.Linear`` (which the lists run in half), and is compared with the same
layer under ``torch.autocast("cpu", dtype=...)``:

* BF16 (O4, and O1 with ``half_dtype=torch.bfloat16``): amp_patch runs the
  kernels under CPU autocast itself, so outputs, hidden states and gradients
  are bit-for-bit autocast's.
* FP16 (O1): the kernels get every floating input in half, hidden state
  included, as under CUDA autocast and Apex (docs/guide.md, "RNN hidden state"). CPU
  autocast computes the same thing given half inputs, so the reference is the
  layer under CPU autocast with its input and hidden state cast to FP16 first:
  bit-for-bit again. (Given FP32 inputs, CPU autocast keeps GRU's and the
  cells' state FP32, and its FP16 LSTM fails in oneDNN.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils._pytree import tree_leaves

import amp_patch
from amp_patch.apex import handle as apex_handle
from helpers import amp

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN:UserWarning")

LAYERS = {
    "LSTM-2-layer-bidirectional": lambda: nn.LSTM(4, 5, num_layers=2, bidirectional=True),
    "LSTM-projected-batch-first": lambda: nn.LSTM(4, 5, proj_size=3, batch_first=True),
    "GRU-2-layer": lambda: nn.GRU(4, 5, num_layers=2),
    "RNN-tanh-bidirectional": lambda: nn.RNN(4, 5, bidirectional=True),
    "RNN-relu-2-layer": lambda: nn.RNN(4, 5, num_layers=2, nonlinearity="relu"),
    "LSTMCell": lambda: nn.LSTMCell(4, 5),
    "GRUCell": lambda: nn.GRUCell(4, 5),
    "RNNCell": lambda: nn.RNNCell(4, 5, nonlinearity="relu"),
}
SETTINGS = [("O1", f16), ("O1", bf16), ("O4", bf16)]


class Fed(nn.Module):
    """The recurrent layer, behind a ``Linear`` on its input when ``fed``.

    ``half_first``: the reference's stand-in for what the FP16 policy does to
    the kernel's inputs: cast the layer's input and hidden state to FP16.
    """

    def __init__(self, rnn: nn.Module, fed: bool):
        super().__init__()
        self.rnn = rnn
        self.linear = nn.Linear(4, 4) if fed else None
        self.half_first = False

    def forward(self, x, hx=None):
        if self.linear is not None:
            x = self.linear(x)
        if self.half_first:
            x = x.half()
            hx = None if hx is None else tuple(h.half() for h in hx) if isinstance(hx, tuple) else hx.half()
        return self.rnn(x, hx)


def _input(name: str) -> torch.Tensor:
    if "Cell" in name:
        return torch.randn(3, 4)
    return torch.randn(3, 6, 4) if "batch-first" in name else torch.randn(6, 3, 4)


def _state(rnn: nn.Module, batch: int = 3):
    """A random FP32 initial state for ``rnn`` (``(h, c)`` for the LSTMs)."""
    if isinstance(rnn, nn.RNNCellBase):
        h = torch.randn(batch, rnn.hidden_size)
        return (h, torch.randn(batch, rnn.hidden_size)) if isinstance(rnn, nn.LSTMCell) else h
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    h = torch.randn(layers, batch, rnn.proj_size or rnn.hidden_size)
    return (h, torch.randn(layers, batch, rnn.hidden_size)) if isinstance(rnn, nn.LSTM) else h


def _run(model: nn.Module, x: torch.Tensor, hx=None) -> tuple:
    """Forward and backward: the floating outputs (output and hidden states),
    the input's gradient, the parameters' gradients."""
    x = x.clone().requires_grad_()
    out = model(x, hx)
    leaves = tree_leaves(out)
    weights = torch.Generator().manual_seed(1)
    sum((t.float() * torch.randn(t.shape, generator=weights)).sum() for t in leaves).backward()
    return [t.detach() for t in leaves], x.grad, [p.grad for p in model.parameters()]


def _reference(model: nn.Module, x: torch.Tensor, half: torch.dtype, hx=None) -> tuple:
    model.half_first = half is f16
    try:
        with torch.autocast("cpu", dtype=half):
            return _run(model, x, hx)
    finally:
        model.half_first = False


def _assert_same(got: tuple, want: tuple, half: torch.dtype) -> None:
    """Same dtypes; the same values, bit for bit under BF16 (the kernels run under
    CPU autocast itself). Under FP16 to FP16's rounding: where torch's kernel
    decomposes into matmuls (an LSTM with projections), autocast casts a
    weight for each of them and sums its gradient in FP32, amp_patch casts it
    once for the kernel."""
    (outs, xg, pgs), (w_outs, w_xg, w_pgs) = got, want

    def same(g, w, what):
        if half is bf16:
            assert torch.equal(g, w), f"{what} differs by {(g.float() - w.float()).abs().max():.3g}"
        else:
            torch.testing.assert_close(g, w, rtol=2 ** -10, atol=2 ** -10, msg=what)

    assert [t.dtype for t in outs] == [t.dtype for t in w_outs]
    for i, (g, w) in enumerate(zip(outs, w_outs)):
        same(g, w, f"output {i}")
    assert xg.dtype == w_xg.dtype == f32
    same(xg, w_xg, "the input's gradient")
    for i, (g, w) in enumerate(zip(pgs, w_pgs)):
        assert g.dtype == w.dtype == f32
        same(g, w, f"parameter {i}'s gradient")


@pytest.mark.parametrize("feed", ["fp32-input", "fed-by-linear", "fed-with-fp32-state"])
@pytest.mark.parametrize("level,half", SETTINGS, ids=[f"{lv}-{h}".replace("torch.", "") for lv, h in SETTINGS])
@pytest.mark.parametrize("name", list(LAYERS))
def test_recurrent_layer_computes_as_under_autocast(name, level, half, feed):
    """Outputs, hidden states and gradients: autocast's dtypes and values."""
    torch.manual_seed(0)
    model, x = Fed(LAYERS[name](), feed != "fp32-input"), _input(name)
    hx = _state(model.rnn) if feed == "fed-with-fp32-state" else None
    want = _reference(model, x, half, hx)
    model.zero_grad()
    with amp(None, None, level, half_dtype=half, loss_scale=1.0):
        got = _run(model, x, hx)
    _assert_same(got, want, half)
    if half is f16 or feed == "fed-by-linear":
        # FP16 casts the state too (CUDA autocast, Apex); a half input makes a half state
        assert all(t.dtype == half for t in got[0]), [t.dtype for t in got[0]]


@pytest.mark.parametrize("level,half", SETTINGS, ids=[f"{lv}-{h}".replace("torch.", "") for lv, h in SETTINGS])
def test_packed_sequence_and_an_explicit_fp32_state(level, half):
    """An LSTM fed a PackedSequence of a Linear's output, given an FP32 (h0, c0)."""
    torch.manual_seed(0)
    lstm, linear = nn.LSTM(4, 5), nn.Linear(4, 4)
    x = torch.randn(6, 3, 4)
    state = (torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    lengths = torch.tensor([6, 4, 3])

    def run():
        y = x.clone().requires_grad_()
        packed = pack_padded_sequence(linear(y), lengths)
        if half is f16 and not amp_patch.is_initialized():  # the FP16 policy's casts, by hand
            packed = packed._replace(data=packed.data.half())
            hx = tuple(h.half() for h in state)
        else:
            hx = state
        out, (h, c) = lstm(packed, hx)
        weights = torch.Generator().manual_seed(1)
        sum((t.float() * torch.randn(t.shape, generator=weights)).sum() for t in (out.data, h, c)).backward()
        params = [*linear.parameters(), *lstm.parameters()]
        return [out.data.detach(), h.detach(), c.detach()], y.grad, [p.grad for p in params]

    with torch.autocast("cpu", dtype=half):
        want = run()
    linear.zero_grad()
    lstm.zero_grad()
    with amp(None, None, level, half_dtype=half, loss_scale=1.0):
        got = run()
    _assert_same(got, want, half)
    # FP16 casts the state (CUDA autocast, Apex); under BF16 the packed (not
    # oneDNN) kernel keeps an FP32 state FP32, as under CPU autocast
    assert [t.dtype for t in got[0]] == [f16 if half is f16 else f32] * 3


def test_torchs_check_is_put_back_exactly():
    """While a session runs, RNNBase.check_input is amp_patch's; after it, torch's
    own function object again, which refuses a half input to an FP32 layer."""
    own = vars(nn.RNNBase)["check_input"]
    lstm, x = nn.LSTM(4, 5), torch.randn(6, 3, 4, dtype=bf16)
    with amp(None, None, "O4"):
        assert vars(nn.RNNBase)["check_input"] is not own
        assert lstm(x)[0].dtype == bf16
    assert vars(nn.RNNBase)["check_input"] is own
    with pytest.raises(ValueError, match="does not match weight dtype"):
        lstm(x)


def test_disable_casts_keeps_torchs_check():
    """Inside ``disable_casts()`` the kernels are not cast, so a half input to
    an FP32 layer is refused with torch's own message, as outside autocast."""
    lstm, x = nn.LSTM(4, 5), torch.randn(6, 3, 4, dtype=bf16)
    with amp(None, None, "O4"):
        with amp_patch.disable_casts(), pytest.raises(ValueError, match="does not match weight dtype"):
            lstm(x)


def test_a_layer_whose_kernel_an_override_removes_keeps_torchs_check():
    """Only the layers whose kernel a list casts skip the dtype check: with
    ``lstm`` removed, an LSTM given a half input is refused; a GRU still runs."""
    x = torch.randn(6, 3, 4, dtype=bf16)
    with amp(None, None, "O4", lists={"torch._VF": {"remove": ["lstm"]}}):
        with pytest.raises(ValueError, match="does not match weight dtype"):
            nn.LSTM(4, 5)(x)
        assert nn.GRU(4, 5)(x)[0].dtype == bf16


def test_shape_checks_still_run():
    with amp(None, None, "O4"):
        with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
            nn.GRU(3, 5)(torch.randn(6, 3, 4, dtype=bf16))
        with pytest.raises(RuntimeError, match="Expected hidden size"):
            nn.GRU(4, 5)(torch.randn(6, 3, 4, dtype=bf16), torch.zeros(1, 2, 5, dtype=bf16))


def test_a_subclass_of_rnnbase_with_its_own_mode_keeps_torchs_check():
    """A module built on RNNBase with a mode amp_patch does not know (no listed
    kernel behind it) is left to torch's check."""
    class Custom(nn.RNNBase):
        def forward(self, x):
            self.check_input(x, None)
            return x

    custom = Custom("LSTM", 4, 5)
    custom.mode = "CUSTOM"
    with amp(None, None, "O4"):
        with pytest.raises(ValueError, match="does not match weight dtype"):
            custom(torch.randn(6, 3, 4, dtype=bf16))


@pytest.mark.filterwarnings("ignore:amp_patch. O1 runs in float16 on the CPU")
def test_apex_handle_runs_rnn_layers_in_half():
    """Apex's 2018 ``amp.init()`` (served by amp_patch) runs the RNN layers in
    FP16 on an FP16 input as on an FP32 one, gradients in the input's dtype."""
    handle = apex_handle.init(enabled=True, half_dtype=f16)
    try:
        assert handle.is_active()
        for cls in (nn.RNN, nn.GRU, nn.LSTM):
            rnn = cls(4, 4, num_layers=2, bidirectional=True)
            for dtype in (f32, f16):
                x = torch.randn(5, 3, 4, dtype=dtype, requires_grad=True)
                out, _ = rnn(x)
                assert out.dtype == f16
                out.float().sum().backward()
                assert x.grad.dtype == dtype
    finally:
        handle._deactivate()
    assert not amp_patch.is_initialized()
