"""Shared fixtures. The autouse fixture proves every test leaves torch unpatched
and nothing on the process's undo stack.

The test files are in subfolders named after the subpackage each tests (tests of
the whole stay here); ``helpers`` and ``op_samples`` are imported from this
folder, which is put on ``sys.path`` first (pytest's default import mode does
that too, the others do not)."""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import tempfile

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import pytest
import torch

from amp_patch.frontends.demo import cpu_flags


def _compile_cache_per_cpu() -> None:
    """A compile cache of torch's for this CPU alone, unless the caller chose one.

    torch.compile's on-disk cache (in the system's temporary folder, which can
    outlive the machine's CPU) does not key a CPU graph by the vector
    instructions it was generated for: read where torch's kernels are narrower
    (another CPU, or another ``ATEN_CPU_CAPABILITY``), its kernels update part of
    each tensor, silently. The folder is named after the CPU's flags, so the
    compiled tests compare against what this CPU computes; the subprocesses the
    tests start inherit it. Set before ``torch._dynamo`` is imported, which
    fixes torch's default when none is set.
    """
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    cpu = " ".join(sorted(cpu_flags() or ()))
    key = hashlib.sha1(f"{platform.machine()} {cpu} {os.environ.get('ATEN_CPU_CAPABILITY', '')}".encode()).hexdigest()[:12]
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"amp_patch_tests_torchinductor_{key}")


_compile_cache_per_cpu()

import torch._dynamo  # noqa: F401  torch imports it on the first optimizer.step(), which rebinds
# torch.manual_seed and adds submodules to vars(torch): imported here, the snapshot
# below compares only what a test changed (amp_patch itself does not import it)
import torch._appdirs  # noqa: F401  torch.compile imports these two lazily, which
import torch._thread_safe_fork  # noqa: F401  adds them to vars(torch) mid-test.
import torch.numa  # noqa: F401  so does transformers' save_pretrained with this one
import torch.nn.functional as F
from torch.utils.data._utils import fetch

import amp_patch
from amp_patch.base.undo import STACK
from amp_patch.oplists import NAMESPACES
from helpers import ENV, Snapshot, fast_path


SNAPSHOT = {name: obj for name, obj in NAMESPACES.items()}
# the DataLoader's fetchers, whose fetch amp_patch runs with casting off
SNAPSHOT.update({f"{fetch.__name__}.{cls.__name__}": cls for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher)})
# the classes and modules amp_patch patches beside the op namespaces: the RNN input check
# (patching.rnn), Parameter.data (precision.writes), TorchScript's module compiler (patching.jit)
SNAPSHOT.update({"torch.nn.RNNBase": torch.nn.RNNBase, "torch.nn.Parameter": torch.nn.Parameter,
                 "torch.jit._recursive": torch.jit._recursive})


#: every test starts from this seed: torch seeds a fresh process at random, so a
#: test that draws unseeded would otherwise see new numbers in every run. Another
#: seed (``AMP_PATCH_TEST_SEED=7 python -m pytest``) looks for a test that holds
#: only for the numbers one seed draws.
SEED = int(os.environ.get("AMP_PATCH_TEST_SEED", "0"))


def pytest_report_header(config):
    return [f"torch.manual_seed({SEED}) before every test (AMP_PATCH_TEST_SEED)",
            f"torch.compile's cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']} (TORCHINDUCTOR_CACHE_DIR)"]


@pytest.fixture(autouse=True)
def seeded():
    """Start every test from one random state, whatever ran before it."""
    torch.manual_seed(SEED)


@pytest.fixture(autouse=True)
def torch_left_unpatched():
    """Fail any test that leaves an attribute of torch changed, naming it."""
    before = Snapshot(SNAPSHOT)
    yield
    leaked_state = amp_patch.is_initialized()
    if leaked_state:
        amp_patch.deinitialize()
    # nothing is left for anyone to undo: every owner popped what it pushed
    leaked_undo = [f"{type(e.owner).__name__}: {e.kind} {type(e.undo).__name__}" for e in STACK._entries]
    for owner in {id(e.owner): e.owner for e in STACK._entries}.values():
        STACK.pop_to(owner, 0)
    problems = before.changed()
    assert not leaked_state, "test left amp_patch initialized (call amp_patch.deinitialize())"
    assert not problems, f"torch left patched: {', '.join(problems[:20])}"
    assert not leaked_undo, f"changes left on the undo stack: {leaked_undo[:10]}"


@pytest.fixture
def clean_env(monkeypatch):
    """Unset every environment variable amp_patch reads, for the test's duration."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["c", "python"])
def wrapper_path(request, monkeypatch):
    """Which wrapper types ``initialize`` builds: the C fast path's or the
    pure-Python ones (what runs where no compiler was there at install)."""
    from amp_patch.patching import wrappers

    if request.param == "c":
        fast_path()
    else:
        monkeypatch.setattr(wrappers, "fast", None)
    return request.param


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption(
        "--skip-slow", action="store_true",
        help="skip the tests marked slow (subprocesses, distributed runs) for a quick local run; CI runs them all",
    )


def pytest_ignore_collect(collection_path, config):
    """A quick run (``-m quick``) does not import the test files that hold no
    quick test: importing them (transformers, for one) costs seconds for nothing."""
    if config.getoption("markexpr", "") == "quick" and collection_path.name.startswith("test_") \
            and collection_path.suffix == ".py":
        return "pytest.mark.quick" not in collection_path.read_text(encoding="utf-8") or None
    return None


def pytest_runtest_setup(item):
    if item.config.getoption("--skip-slow") and item.get_closest_marker("slow") is not None:
        pytest.skip("marked slow; run without --skip-slow to include it")
