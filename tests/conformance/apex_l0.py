"""Run NVIDIA Apex's own L0 amp tests against amp_patch's ``apex`` alias, on CPU.

The project carries no Apex code: this script reads the test files from a
local Apex checkout at run time (a git directory, at the commit that still has
``apex/amp``), rewrites nothing but the device (``.cuda()``, ``device='cuda'``,
``torch.cuda.*Tensor``) so they run on the CPU, chooses FP16 through
``AMP_PATCH_HALF_DTYPE=float16``, serves ``apex`` from amp_patch
(``install_apex_alias``) and runs them with unittest. Not collected by pytest.

    python tests/conformance/apex_l0.py APEX_GIT_DIR [--commit e13873de] [-v]

Prints one line per test file and the total, and exits non-zero when any test
failed. ``test_basic_casts``'s ``test_cpu_is_float`` checks that a CPU tensor
stays FP32 under Apex, which cast only CUDA tensors; on the CPU amp_patch is
the one casting, so that test is skipped with that reason.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

FILES = ("test_cache", "test_promotion", "test_basic_casts", "test_add_param_group", "test_checkpointing",
         "test_multiple_models_optimizers_losses")
SKIP = {
    "test_basic_casts.TestTensorCasts.test_cpu_is_float": "Apex cast CUDA tensors only; on the CPU amp_patch casts",
}
#: device rewrites, in order: the only change made to Apex's files
REWRITES = (
    (re.compile(r"\.cuda\(\)"), ""),
    (re.compile(r"device\s*=\s*['\"]cuda['\"]"), "device='cpu'"),
    (re.compile(r"\.to\(\s*['\"]cuda['\"]\s*\)"), ".to('cpu')"),
    (re.compile(r"torch\.cuda\.(Float|Half|Double|Long|Int|BFloat16)Tensor"), r"torch.\1Tensor"),
)


def rewrite(text: str) -> str:
    for pattern, repl in REWRITES:
        text = pattern.sub(repl, text)
    return text


def read(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("apex_git_dir", help="a local Apex git directory (fetch github:NVIDIA/apex)")
    ap.add_argument("--commit", default="e13873de", help="the Apex commit to read the tests from")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    os.environ["AMP_PATCH_HALF_DTYPE"] = "float16"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from amp_patch.frontends.alias import install_apex_alias

    install_apex_alias()
    work = Path(tempfile.mkdtemp(prefix="apex_l0_"))
    base = "tests/L0/run_amp"
    for name in ("utils",) + FILES:
        (work / f"{name}.py").write_text(rewrite(read(args.apex_git_dir, args.commit, f"{base}/{name}.py")))
    sys.path.insert(0, str(work))

    total = {"run": 0, "failures": 0, "errors": 0, "skipped": 0}
    for name in FILES:
        suite = unittest.defaultTestLoader.loadTestsFromName(name)
        _skip(suite)
        result = unittest.TextTestRunner(verbosity=2 if args.verbose else 0, stream=sys.stderr).run(suite)
        bad = len(result.failures) + len(result.errors)
        print(f"{name}: {result.testsRun - bad - len(result.skipped)} passed, {bad} failed, "
              f"{len(result.skipped)} skipped", flush=True)
        total["run"] += result.testsRun
        total["failures"] += len(result.failures)
        total["errors"] += len(result.errors)
        total["skipped"] += len(result.skipped)
    failed = total["failures"] + total["errors"]
    passed = total["run"] - failed - total["skipped"]
    print(f"apex L0: {passed} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if failed else 0


def _skip(suite) -> None:
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            _skip(t)
            continue
        key = ".".join(t.id().split(".")[-3:])
        if key in SKIP:
            setattr(t, t._testMethodName, unittest.skip(SKIP[key])(getattr(t, t._testMethodName)))


if __name__ == "__main__":
    sys.exit(main())
