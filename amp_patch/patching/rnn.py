"""``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` fed a half input at O1/O4.

Their kernels (``torch._VF.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``) are on
the ``half`` list, which casts the input, the hidden state and the weights.
But ``nn.RNNBase.forward`` first checks that the input's dtype is the
weights', and raises unless autocast is on (``torch._C._is_any_autocast_enabled()``,
which amp_patch never changes): a ``Linear`` that the lists run in half, fed
into an FP32 ``LSTM``, would stop there. So, while a session patches the
kernels, ``nn.RNNBase.check_input`` skips the dtype part of its check for the
modules whose kernel a list casts, as torch skips it under autocast; the
shape checks still run. The cells (``nn.LSTMCell`` and kin) check no dtype.
"""
from __future__ import annotations

from threading import get_ident
from typing import Collection, List

import wrapt
from torch import nn

from .cast import CASTABLE
from .registry import PatchItem
from .wrappers import Live, disabled

#: the ``torch._VF`` kernel ``nn.RNNBase.forward`` calls for each ``mode``
KERNELS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def check_input_items(listed: Collection, live: Live) -> List[PatchItem]:
    """The patch of ``nn.RNNBase.check_input`` for a session whose op table
    holds the keys ``listed`` (``(namespace, name)``); none when no RNN
    kernel is listed (an override removed them all)."""
    modes = frozenset(mode for mode, kernel in KERNELS.items() if ("torch._VF", kernel) in listed)
    if not modes:
        return []
    # A wrapt wrapper, not a plain function: TorchScript compiles a method from
    # the source, globals and closure it finds on it, which wrapt passes
    # through from torch's own check_input.
    return [(nn.RNNBase, "check_input", lambda original: wrapt.FunctionWrapper(original, _lenient(modes, live)))]


def _lenient(modes: frozenset, live: Live):
    def check_input(wrapped, module, args, kwargs):
        casting = live.on and not (disabled and get_ident() in disabled)
        if casting and module is not None and args and getattr(module, "mode", None) in modes:
            input, weight = args[0], module._flat_weights[0]
            if input.dtype is not weight.dtype and input.dtype in CASTABLE and weight.dtype in CASTABLE:
                # torch's own check on a stand-in with the weights' dtype and the
                # input's shape (one element seen through zero strides: no copy)
                args = (input.new_empty((), dtype=weight.dtype).expand(input.shape),) + tuple(args[1:])
        return wrapped(*args, **kwargs)

    return check_input
