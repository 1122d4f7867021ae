"""``apex.optimizers.fused_novograd``: Apex's module of ``FusedNovoGrad``, which scripts import
by its path (``import apex.optimizers.fused_novograd as m``)."""
from . import FusedNovoGrad

__all__ = ["FusedNovoGrad"]
