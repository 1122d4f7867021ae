"""``apex.mlp``: ``MLP``, its autograd function ``MlpFunction`` and ``mlp_function``."""
from .mlp import MLP, MlpFunction, mlp_function

__all__ = ["MLP", "MlpFunction", "mlp_function"]
