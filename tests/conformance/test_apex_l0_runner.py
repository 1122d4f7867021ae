"""``tests/conformance/apex_l0.py``, the runner CI uses for NVIDIA Apex's own
L0 amp tests, on a folder of stand-in test files: it moves only the device to
the CPU, serves ``apex`` from the alias, and its exit code fails CI when a test
fails, when no test ran, or when a named file is not there."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("apex_l0.py")

GOOD = '''
import os, unittest, torch
from apex import amp
from utils import ON

class Moved(unittest.TestCase):
    def test_cuda_becomes_cpu(self):
        self.assertEqual(torch.ones(2).cuda().device.type, "cpu")
        self.assertEqual(torch.zeros(2, device="cuda").device.type, "cpu")
        self.assertEqual(torch.ones(2).to("cuda").device.type, "cpu")
        self.assertEqual(torch.cuda.HalfTensor(2).dtype, torch.float16)
        self.assertEqual(ON, "cpu")

    def test_apex_is_the_alias_in_fp16(self):
        self.assertEqual(amp.__name__.split(".")[0], "amp_patch")
        self.assertEqual(os.environ["AMP_PATCH_HALF_DTYPE"], "float16")

    def test_every_test_starts_seeded(self):
        drawn = torch.rand(3)  # torch seeds a fresh process at random: this is the runner's seed
        torch.manual_seed(0)
        self.assertTrue(torch.equal(drawn, torch.rand(3)))
'''
BAD = '''
import unittest

class Broken(unittest.TestCase):
    def test_fails(self):
        self.assertEqual(1, 2)
'''


@pytest.fixture
def apex_tests(tmp_path):
    folder = tmp_path / "apex-l0"
    folder.mkdir()
    (folder / "utils.py").write_text("import torch\nON = torch.ones(1).cuda().device.type\n")
    (folder / "test_good.py").write_text(GOOD)
    (folder / "test_bad.py").write_text(BAD)
    return folder


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), str(folder), *args], cwd=folder.parent,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_runner_passes_a_passing_file_and_fails_a_failing_one(apex_tests):
    res = _run(apex_tests, "--skip", "test_bad")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "test_good: 3 passed, 0 failed, 0 skipped" in res.stdout
    assert "apex L0: 3 passed, 0 failed, 0 skipped, files left out: test_bad" in res.stdout

    res = _run(apex_tests)  # every file, by default
    assert res.returncode == 1, res.stdout + res.stderr
    assert "test_bad: 0 passed, 1 failed" in res.stdout and "apex L0: 3 passed, 1 failed" in res.stdout


@pytest.mark.slow
def test_the_runner_fails_when_no_test_ran_or_a_file_is_missing(apex_tests):
    res = _run(apex_tests, "--only", "test_good", "--skip", "test_good")
    assert res.returncode == 1 and "apex L0: 0 passed, 0 failed" in res.stdout, res.stdout + res.stderr

    res = _run(apex_tests, "--skip", "test_rnn")
    assert res.returncode == 2 and "no such Apex test file: test_rnn" in res.stderr, res.stderr
