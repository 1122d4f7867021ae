"""A stand-in package's submodules as its attributes, each imported on first use.

``import apex`` made most of Apex's submodules attributes without another
import: each package's ``__init__`` imported its submodules, and ``apex.amp``
imported ``apex.contrib.optimizers`` (``import apex`` then
``apex.contrib.optimizers.FP16_Optimizer`` worked). The stand-ins import
lazily instead: a package that does not import every submodule itself ends
with ``__getattr__ = submodule_getattr(__name__)``, so each chain of
attributes that names a served module reaches it, as ``amp-patch
check-script`` reports it does.
"""
from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Callable


def submodule_getattr(package: str) -> Callable[[str], types.ModuleType]:
    """A module ``__getattr__`` for ``package``: a name that is a submodule of
    it is imported and returned; any other raises ``AttributeError``, as
    a module without one would."""

    def __getattr__(name: str) -> types.ModuleType:
        if not (name.startswith("__") and name.endswith("__")):
            full = f"{package}.{name}"
            if importlib.util.find_spec(full) is not None:
                return importlib.import_module(full)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
