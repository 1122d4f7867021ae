"""``apex.fused_dense``: ``FusedDense``, ``FusedDenseGeluDense`` and their functions."""
from .fused_dense import (DenseNoBiasFunc, FusedDense, FusedDenseFunc, FusedDenseGeluDense, FusedDenseGeluDenseFunc,
                          _dense_no_bias, _fused_dense, _fused_dense_gelu_dense)

__all__ = ["FusedDense", "FusedDenseGeluDense", "FusedDenseFunc", "DenseNoBiasFunc", "FusedDenseGeluDenseFunc",
           "_fused_dense", "_dense_no_bias", "_fused_dense_gelu_dense"]
