"""The ``apex`` alias: ``import apex`` / ``from apex import amp`` resolve to amp_patch.

Apex's ``apex.amp`` is gone from current Apex releases, and many training
scripts still import it. ``install_apex_alias()`` makes those imports work
unchanged, but only when no real ``apex.amp`` can be imported: a real one is
always left in charge.

Two cases:

* no ``apex`` at all: an import hook serves a stand-in ``apex`` package whose
  ``amp`` is ``amp_patch.amp``, only when a script imports it; importing any
  other ``apex.*`` module (``apex.parallel``, ``apex.optimizers`` ...) fails
  with a message naming the torch replacement.
* an ``apex`` without ``amp`` (newer Apex, kept for its fused kernels): only
  ``apex.amp`` is added; the rest of the real package is untouched.
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
from typing import Optional

from .. import amp

log = logging.getLogger("amp_patch")

#: what to use instead of the Apex modules the stand-in package does not have
REPLACEMENTS = {
    "apex.parallel": "torch.nn.parallel.DistributedDataParallel, and "
    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) for convert_syncbn_model",
    "apex.optimizers": "torch.optim.AdamW(..., fused=True) / torch.optim.Adam(..., fused=True) "
    "for FusedAdam, torch.optim.SGD(..., fused=True) for FusedSGD",
    "apex.normalization": "torch.nn.LayerNorm / torch.nn.RMSNorm (fused kernels on CUDA) for FusedLayerNorm",
    "apex.fp16_utils": "amp_patch.initialize(model, optimizer, opt_level='O2') for FP16_Optimizer and network_to_half",
    "apex.contrib": "the torch equivalents of the kernel you used (torch.nn.functional.scaled_dot_product_attention, fused optimizers)",
}

_lock = threading.Lock()
_finder: Optional["_AliasFinder"] = None
_real_apex: Optional[types.ModuleType] = None  # an Apex without amp that we added amp to
_announced = False


def _hint(fullname: str) -> str:
    top = ".".join(fullname.split(".")[:2])
    return (
        f"Apex is not installed, and amp_patch's apex alias provides only apex.amp. "
        f"Use {REPLACEMENTS.get(top, 'its torch equivalent')}."
    )


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``apex`` (when Apex is absent) and ``apex.amp`` on import, lazily,
    and turns imports of Apex's other modules into errors that say what to use."""

    def __init__(self, stand_in: bool):
        self.stand_in = stand_in

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "apex.amp":
            return importlib.machinery.ModuleSpec(fullname, self)
        if not self.stand_in:
            return None
        if fullname == "apex":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname.startswith("apex."):
            raise ModuleNotFoundError(f"No module named {fullname!r}: {_hint(fullname)}", name=fullname)
        return None

    def create_module(self, spec):
        if spec.name == "apex":
            pkg = types.ModuleType("apex", "Stand-in for NVIDIA Apex: only apex.amp, served by amp_patch.amp.")
            pkg.__getattr__ = _package_getattr  # `import apex; apex.amp.scale_loss(...)`
            return pkg
        self._amp_spec = amp.__spec__
        return amp

    def exec_module(self, module):
        if module.__name__ == "amp_patch.amp":
            module.__spec__ = self._amp_spec  # the import system rewrote it to apex.amp's
        _announce()


def _package_getattr(name: str):
    if name == "amp":
        return importlib.import_module("apex.amp")
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
    """Make ``import apex`` / ``from apex import amp`` resolve to amp_patch.

    Does nothing when a real ``apex.amp`` is importable. Otherwise ``apex.amp``
    becomes ``amp_patch.amp`` (with a stand-in ``apex`` package if Apex is
    absent altogether), and the first import of it says so once through the
    ``amp_patch`` logger. Calling it again is harmless. The launcher
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
        if sys.modules.get("apex.amp") is amp:
            del sys.modules["apex.amp"]
        apex = sys.modules.get("apex")
        if apex is not None and getattr(apex, "__spec__", None) is not None and apex.__spec__.loader is _finder:
            del sys.modules["apex"]
        if _real_apex is not None and vars(_real_apex).get("amp") is amp:
            del _real_apex.amp
        _finder = _real_apex = None


def is_installed() -> bool:
    """True while the alias (not a real ``apex.amp``) serves ``apex.amp``."""
    return _finder is not None
