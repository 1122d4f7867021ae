"""``apex.mlp``: ``MLP``."""
from .mlp import MLP

__all__ = ["MLP"]
