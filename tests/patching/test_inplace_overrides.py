"""An op moved by an op-list override keeps its in-place semantics.

``F.relu(x, inplace=True)`` (and every functional with an ``inplace``
argument), ``out=`` tensors and item assignment write into a tensor the
caller holds. A casting wrapper must not turn that into a write to a
temporary copy: keyword in-place calls write their result back into the
receiver (in its own dtype), an ``out=`` call runs uncast (autocast's rule),
and the protocol writes that cannot be wrapped (``__setitem__``) are refused
by the validator, naming why.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import ListError
from helpers import amp

bf16 = torch.bfloat16

#: every functional of torch.nn.functional with an ``inplace`` argument, with its extra arguments
KEYWORD_INPLACE = {
    "relu": (), "relu6": (), "elu": (), "selu": (), "celu": (), "leaky_relu": (0.1,), "hardtanh": (),
    "rrelu": (), "threshold": (0.1, 0.0), "silu": (), "mish": (), "hardswish": (), "hardsigmoid": (),
    "dropout": (0.5,), "dropout1d": (0.5,), "dropout2d": (0.5,), "dropout3d": (0.5,), "alpha_dropout": (0.5,),
    "feature_alpha_dropout": (0.5,),
}
RANDOM = {"rrelu", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}


def test_the_table_names_every_functional_with_an_inplace_argument():
    import inspect

    have = set()
    for name in dir(F):
        fn = getattr(F, name)
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if "inplace" in params:
            have.add(name)
    assert have == set(KEYWORD_INPLACE)


def _input(name):
    torch.manual_seed(0)
    shape = (2, 3, 4, 4, 4) if name == "dropout3d" else (2, 3, 4, 4) if name == "dropout2d" else (2, 3, 8)
    return torch.randn(shape).to(bf16)


@pytest.mark.parametrize("by", ["keyword", "position"])
@pytest.mark.parametrize("name", sorted(KEYWORD_INPLACE))
def test_a_keyword_inplace_functional_moved_to_float_stays_in_place(name, by):
    x = _input(name)
    before = x.clone()
    extra = KEYWORD_INPLACE[name]
    fn = getattr(F, name)
    import inspect

    params = list(inspect.signature(fn).parameters)
    with amp(None, None, "O4", lists={"torch.nn.functional": {"float": [name]}}):
        if by == "keyword":
            out = fn(x, *extra, inplace=True) if name not in RANDOM else fn(x, *extra, training=True, inplace=True) \
                if "training" in params else fn(x, *extra, inplace=True)
        else:
            args = [x] + list(extra)
            while len(args) < params.index("inplace"):
                args.append(inspect.signature(fn).parameters[params[len(args)]].default)
            if "training" in params:
                args[params.index("training")] = True
            out = fn(*args, True)
    assert out is x, "the call returns its receiver, as in plain torch"
    assert x.dtype == bf16
    if name in RANDOM:
        assert not torch.equal(x, before), "the receiver changed"
    else:
        want = fn(before.float(), *extra).to(bf16)  # computed in FP32, as the override asks, then stored
        assert torch.equal(x, want)


def test_out_of_place_calls_of_a_moved_functional_still_return_a_new_tensor():
    x = _input("relu")
    before = x.clone()
    with amp(None, None, "O4", lists={"torch.nn.functional": {"float": ["relu"]}}):
        out = F.relu(x)
    assert out.dtype == torch.float32 and torch.equal(x, before)


@pytest.mark.parametrize("out_dtype", [torch.float32, bf16])
def test_an_out_tensor_is_filled_uncast_as_autocast_does(out_dtype):
    """``out=`` fixes the result's dtype, so the call runs as written (autocast's rule)."""
    a, b = torch.randn(4, 4).to(out_dtype), torch.randn(4, 4).to(out_dtype)
    out = torch.empty(4, 4, dtype=out_dtype)
    with amp(None, None, "O4", lists={"torch": {"float": ["add"]}}):
        got = torch.mm(a, b, out=out)
        added = torch.add(a, b, out=torch.empty(4, 4, dtype=out_dtype))
    assert got is out and out.dtype == out_dtype
    assert torch.equal(out, torch.mm(a, b)) and torch.equal(added, a + b)


@pytest.mark.parametrize("policy", ["float", "half", "promote"])
@pytest.mark.parametrize("name", ["__setitem__", "__delitem__"])
def test_item_assignment_cannot_be_listed(name, policy):
    with pytest.raises(ListError, match=rf"torch.Tensor.{name} writes into its receiver .*Remove the entry"):
        amp_patch.initialize(None, None, "O1", lists={"torch.Tensor": {policy: [name]}})
    assert not amp_patch.is_initialized()
