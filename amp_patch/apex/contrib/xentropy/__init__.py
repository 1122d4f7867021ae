"""``apex.contrib.xentropy``: ``SoftmaxCrossEntropyLoss``."""
from .softmax_xentropy import SoftmaxCrossEntropyLoss

__all__ = ["SoftmaxCrossEntropyLoss"]
