"""The ``apex`` alias: Apex-era imports resolve to amp_patch's stand-ins.

Current Apex releases deleted ``apex.amp``, ``apex.parallel`` and
``apex.fp16_utils``, and ship ``apex.optimizers``, ``apex.normalization`` and
``amp_C`` (and ``apex_C``, ``fused_adam_cuda``, ...) only as CUDA extensions
that many installs cannot build. Scripts still import them. ``install_apex_alias()`` makes those imports work
unchanged; a real module of the same name, where one can be imported, is
always left in charge.

Two cases:

* no ``apex`` at all: an import hook serves a stand-in ``apex`` package whose
  modules are the stand-ins in ``STANDINS`` (``apex.amp`` is
  ``amp_patch.amp``, ``apex.parallel`` is ``amp_patch.apex.parallel``, ...),
  each only when a script imports it. Importing an Apex module amp_patch
  does not serve (``apex.transformer``, ``apex.contrib.fmha``, ...) fails
  with a message naming the torch replacement (``REPLACEMENTS``).
* an ``apex`` without ``amp`` (newer Apex, kept for its fused kernels): the
  stand-ins are served only for the modules that Apex lacks; the rest of the
  real package is untouched.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from typing import Optional, Sequence, Union

from .. import amp
from ..apex.standins import REPLACEMENTS, STANDINS

log = logging.getLogger("amp_patch")

#: top-level modules the alias answers for: Apex's compiled extensions
EXTENSIONS = frozenset(n for n in (*STANDINS, *REPLACEMENTS) if "." not in n and n != "apex")

_lock = threading.Lock()
_finder: Optional["_AliasFinder"] = None
_real_apex: Optional[types.ModuleType] = None  # an Apex without amp that we added amp to
_announced = False


def replacement(fullname: str) -> str:
    """What to use instead of an Apex module amp_patch does not serve."""
    parts = fullname.split(".")
    for n in range(len(parts), 0, -1):
        instead = REPLACEMENTS.get(".".join(parts[:n]))
        if instead is not None:
            return f"use {instead}"
    return "use its torch equivalent"


def _hint(fullname: str) -> str:
    served = ", ".join(n for n in STANDINS if n.count(".") == 1)
    extensions = ", ".join(n for n in STANDINS if "." not in n)
    use = replacement(fullname)
    return (f"Apex is not installed, and amp_patch's apex alias serves {served} (not all of their submodules) "
            f"and the extensions {extensions}. {use[0].upper()}{use[1:]}.")


def _not_served(fullname: str) -> ModuleNotFoundError:
    """The error for an Apex module amp_patch does not serve. It carries no
    ``name``, so ``from apex import RNN`` reports it too (the import system
    drops a ModuleNotFoundError named after the submodule it tried there)."""
    return ModuleNotFoundError(f"No module named {fullname!r}: {_hint(fullname)}")


def standin_of(fullname: str) -> Union[str, types.ModuleType, None]:
    """The module name (or, for ``apex.amp``'s submodules, the module) that
    stands in for ``fullname``, or None when amp_patch serves no such module."""
    if fullname.startswith("apex.amp."):
        head, _, rest = fullname[len("apex.amp."):].partition(".")
        module = amp.SUBMODULES.get(head)
        if module is None or not rest:
            return module
        # a submodule of a package that stands in (apex.amp.lists.functional_overrides)
        return f"{module.__name__}.{rest}" if hasattr(module, "__path__") else None
    if fullname in STANDINS:
        return STANDINS[fullname]
    for name in sorted(STANDINS, key=len, reverse=True):
        if fullname.startswith(name + "."):
            return STANDINS[name] + fullname[len(name):]
    return None


def standin_module(fullname: str) -> Optional[types.ModuleType]:
    """The module that stands in for ``fullname``, imported, or None when amp_patch
    serves no such module (``apex.parallel.nothing`` as much as ``apex.contrib``)."""
    standin = standin_of(fullname)
    if standin is None or isinstance(standin, types.ModuleType):
        return standin
    try:
        return importlib.import_module(standin)
    except ModuleNotFoundError as e:
        if e.name is not None and (standin == e.name or standin.startswith(e.name + ".")):
            return None
        raise  # a stand-in that exists and fails to import: that error is the news


def _real_spec(fullname: str, path: Optional[Sequence[str]], finder: object) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of a real module of this name, looking past this finder; None
    when there is none, or when a stand-in serves its parent (whose path is
    amp_patch's own, so what is found there is the stand-in's submodule)."""
    parent = fullname.rpartition(".")[0]
    if parent:
        mod = sys.modules.get(parent)
        if mod is None or mod.__name__ != parent or getattr(mod.__spec__, "loader", None) is finder:
            return None
    try:
        return importlib.machinery.PathFinder.find_spec(fullname, path)
    except (ImportError, ValueError):
        return None


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``apex`` (when Apex is absent) and the stand-ins, lazily, and
    turns imports of the Apex modules amp_patch lacks into errors that say what to use."""

    def __init__(self, stand_in: bool):
        self.stand_in = stand_in
        self._specs: dict = {}  # served name -> the stand-in's own spec, put back after loading

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "apex":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if self.stand_in else None
        extension = fullname in EXTENSIONS
        if not extension and not fullname.startswith("apex."):
            return None
        if standin_of(fullname) is None:
            if (self.stand_in and not extension) or (extension and _real_spec(fullname, path, self) is None):
                raise _not_served(fullname)
            return None
        if fullname != "apex.amp" and not fullname.startswith("apex.amp.") and _real_spec(fullname, path, self) is not None:
            return None  # a real Apex module (or a real amp_C, ...) stays in charge
        module = standin_module(fullname)
        if module is None:  # a module of a served package that amp_patch does not serve
            raise _not_served(fullname)
        self._specs[fullname] = module.__spec__
        return importlib.machinery.ModuleSpec(fullname, self, is_package=hasattr(module, "__path__"))

    def create_module(self, spec):
        if spec.name == "apex":
            pkg = types.ModuleType("apex", "Stand-in for NVIDIA Apex, served by amp_patch (see amp_patch.apex).")
            pkg.__getattr__ = _package_getattr  # `import apex; apex.amp.scale_loss(...)`
            return pkg
        return standin_module(spec.name)

    def exec_module(self, module):
        served = module.__spec__.name  # the import system set it to the name served
        own = self._specs.pop(served, None)
        if own is not None:
            module.__spec__ = own  # ... and the stand-in keeps its own
        # apex.amp's submodules are served by modules outside amp_patch.amp;
        # they go into sys.modules now, so importing one never sets it as an
        # attribute of amp: `_amp_state` must stay amp's state object, as in Apex
        if module is amp:
            for sub, mod in amp.SUBMODULES.items():
                sys.modules.setdefault(f"apex.amp.{sub}", mod)
            _announce()


def _package_getattr(name: str):
    if standin_of(f"apex.{name}") is not None:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' has no attribute {name!r}: {_hint('apex.' + name)}")


def _real_apex_amp_importable() -> bool:
    """True when an installed Apex has its own ``amp``; imports ``apex`` to ask."""
    try:
        if importlib.util.find_spec("apex") is None:
            return False
        return importlib.util.find_spec("apex.amp") is not None
    except (ImportError, ValueError):
        # A broken Apex install (e.g. missing compiled extensions) cannot serve
        # apex.amp either; the alias takes over and says so.
        return False


def install_apex_alias() -> bool:
    """Make Apex-era imports (``from apex import amp``, ``from apex.parallel import
    DistributedDataParallel``, ``from apex.fp16_utils import *``, ``import amp_C``,
    ...) resolve to amp_patch's stand-ins (``STANDINS``).

    Does nothing when a real ``apex.amp`` is importable. Otherwise ``apex.amp``
    becomes ``amp_patch.amp`` (with a stand-in ``apex`` package if Apex is
    absent altogether), every other module in ``STANDINS`` is served where no
    real one exists, and the first import of ``apex.amp`` says so once through
    the ``amp_patch`` logger. Calling it again is harmless. The launcher
    (``amp-patch run``) calls it for you.

    Returns:
        True when the alias is in place, False when the real ``apex.amp`` is used.

    Example::

        import amp_patch
        amp_patch.install_apex_alias()
        from apex import amp          # amp_patch.amp, with apex.amp's API
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    """
    global _finder, _real_apex
    with _lock:
        if _finder is not None:
            return True
        if _real_apex_amp_importable():
            log.info("amp_patch: a real apex.amp is installed; the apex alias is not needed and was not installed")
            return False
        real = sys.modules.get("apex")
        if real is None and importlib.util.find_spec("apex") is not None:
            real = importlib.import_module("apex")
        _finder = _AliasFinder(stand_in=real is None)
        sys.meta_path.insert(0, _finder)
        if real is not None:
            # An Apex kept for its kernels: `apex.amp` must work as an attribute too.
            real.amp = amp
            _real_apex = real
            _announce()
        return True


def _announce() -> None:
    global _announced
    if not _announced:
        _announced = True
        log.warning(
            "amp_patch: apex.amp is not installed; `apex.amp` resolves to amp_patch.amp "
            "(see 'Migrating from apex.amp' in amp_patch's README)"
        )


def remove_apex_alias() -> None:
    """Undo ``install_apex_alias()``: ``apex`` is as it was before.

    Example::

        amp_patch.install_apex_alias()
        ...
        amp_patch.frontends.alias.remove_apex_alias()
    """
    global _finder, _real_apex
    with _lock:
        if _finder is None:
            return
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        served = []
        for name in [n for n in sys.modules if n in EXTENSIONS or n.startswith("apex.")]:
            standin = standin_of(name)
            module = standin if isinstance(standin, types.ModuleType) else sys.modules.get(standin or "")
            if module is not None and sys.modules[name] is module:
                served.append(module)
                del sys.modules[name]
        apex = sys.modules.get("apex")
        if apex is not None and getattr(apex, "__spec__", None) is not None and apex.__spec__.loader is _finder:
            del sys.modules["apex"]
        if _real_apex is not None:
            for key in [k for k, v in vars(_real_apex).items() if v is amp or any(v is m for m in served)]:
                delattr(_real_apex, key)
        _finder = _real_apex = None


def is_installed() -> bool:
    """True while the alias (not a real ``apex.amp``) serves ``apex.amp``."""
    return _finder is not None
