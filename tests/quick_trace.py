"""A pytest plugin for ``test_packaging``'s check that the quick run reaches
every subpackage: it records the files of the functions that run (module
bodies, which only import, do not count) and writes them, one a line, to
``$AMP_PATCH_TRACE_OUT`` when the run ends.

    AMP_PATCH_TRACE_OUT=ran.txt PYTHONPATH=tests python -m pytest -q -m quick -p quick_trace
"""
from __future__ import annotations

import os
import sys
import threading

_ran: set = set()


def _profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name != "<module>":
        _ran.add(frame.f_code.co_filename)


def pytest_configure(config):
    sys.setprofile(_profile)
    threading.setprofile(_profile)


def pytest_unconfigure(config):
    sys.setprofile(None)
    threading.setprofile(None)
    with open(os.environ["AMP_PATCH_TRACE_OUT"], "w", encoding="utf-8") as f:
        f.write("\n".join(sorted(_ran)) + "\n")
