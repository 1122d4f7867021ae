"""Fixtures of the Apex stand-in tests."""
from __future__ import annotations

import logging
import sys

import pytest

import amp_patch
from amp_patch.frontends import alias


@pytest.fixture
def apex_alias(monkeypatch, caplog):
    """The apex alias installed, with no apex module imported before or left after."""
    monkeypatch.setattr(alias, "_announced", False)
    caplog.set_level(logging.ERROR, logger="amp_patch")
    saved = list(sys.meta_path)
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.") or m in alias.EXTENSIONS]:
        monkeypatch.delitem(sys.modules, name)
    amp_patch.install_apex_alias()
    yield
    alias.remove_apex_alias()
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        del sys.modules[name]
    sys.meta_path[:] = saved
