"""``apex.contrib.group_norm``: ``GroupNorm``."""
from .group_norm import GroupNorm

__all__ = ["GroupNorm"]
