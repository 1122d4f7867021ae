"""Op lists: which torch functions run in the half dtype, in FP32, or at the
widest input dtype, as editable YAML (the shipped files in ``lists/``, a user's
overrides on top).

``load`` reads, validates and resolves them (``oplists.loading``), all or
nothing, every problem naming its file, line and the nearest valid name;
``schema`` holds the policies and the in-place rules; ``view`` the CLI's
table (``amp-patch lists``).
"""
from __future__ import annotations

from .loading import (ENTRY_KEYS, ENV_VAR, MAX_BYTES, NAMESPACES, OPERATOR_FORMS, WHEN_KEYS, Entry, ListSource,
                   OpTable, collect_problems, default_files, inplace_name, load, normalize_sources,
                   not_an_op, op_exists)

__all__ = ["ENTRY_KEYS", "ENV_VAR", "MAX_BYTES", "NAMESPACES", "OPERATOR_FORMS", "WHEN_KEYS", "Entry", "ListSource",
           "OpTable", "collect_problems", "default_files", "inplace_name", "load", "normalize_sources", "not_an_op",
           "op_exists"]
