"""Loss scaling: scale_loss, the patched backward and optimizer.step."""
from __future__ import annotations


def validate_options(props, options) -> None:
    """Check loss-scaler options before anything changes."""


def attach(amp, optimizers, fresh: bool) -> None:
    """Give each loss a scaler and patch each optimizer's step."""


def make_backward_patch(amp):
    """The ``Tensor.backward`` patch: loss scaling, then an empty cast cache."""
    import wrapt

    def backward(wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        finally:
            amp.cache.clear()

    return lambda original: wrapt.FunctionWrapper(original, backward)
