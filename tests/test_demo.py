"""The demo: the tutorial's SimpleNet in FP32, O1 and O2, and its table."""
from __future__ import annotations

import os
import re
import subprocess
import warnings
import sys

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch.frontends import demo

SMALL = ["--size", "32", "--batch-size", "8", "--batches", "2", "--epochs", "2", "--warmup", "1", "--no-progress"]


def _rows(out: str) -> dict:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    rows = {}
    for line in lines[head + 1:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line
    return rows


def _fp32_reference_losses() -> tuple:
    """The FP32 loop, written out, on targets a fixed linear map of the inputs
    (the demo's data and seeds): the loss at the first and the last step."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 32, generator=g) / 32 ** 0.5
    xs = [torch.randn(8, 32, generator=g) for _ in range(2)]
    data = [(x, x @ teacher) for x in xs]
    torch.manual_seed(0)
    model = demo.SimpleNet(32, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mse = nn.MSELoss()
    losses = []
    for i in range(1 + 4):
        x, y = data[i % 2]
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def _o2_available() -> bool:
    model = demo.SimpleNet(4, 4)
    try:
        amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    except amp_patch.ConfigError:
        return False
    amp_patch.deinitialize()
    return True


def test_demo_prints_the_comparison_table(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert out.startswith("amp_patch demo: SimpleNet (3 x Linear 32->32, ReLU), MSE loss, Adam; batch 8, "
                          "4 timed steps after 1 warm-up; cpu (CPU half dtype: bfloat16)")
    rows = _rows(out)
    assert list(rows) == ["FP32", "O1", "O2"]
    # the O2 row is the default O2, whose step is the one-pass kernel where it is built
    built = amp_patch.precision.kernel.native is not None
    assert ("O2's optimizer step (the default, no option): one pass in C per parameter for 6 of 6 steps" in out) is built  # 1 + 4 timed + the memory probe

    f = re.match(r"FP32\s+[\d.]+ ms\s+1\.00x\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+linear x3 float32, relu x2 float32, loss float32$",
                 rows["FP32"])
    assert f, rows["FP32"]
    first, last = _fp32_reference_losses()
    assert float(f.group(1)) == pytest.approx(first, abs=1e-4) and float(f.group(2)) == pytest.approx(last, abs=1e-4)
    assert last < first  # the column shows the network learning

    m = re.match(r"O1\s+[\d.]+ ms\s+[\d.]+x\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+(.*)$", rows["O1"])
    assert m, rows["O1"]
    assert m.group(3) == "linear x3 bfloat16, relu x2 bfloat16, loss float32"
    assert float(m.group(2)) == pytest.approx(last, rel=0.05)  # BF16 trains the same net
    assert float(m.group(2)) < float(m.group(1))

    if _o2_available():
        assert re.match(r"O2\s+[\d.]+ ms\s+[\d.]+x\s+[\d.]+ -> [\d.]+\s+[\d.]+ MiB\s+linear x3 bfloat16", rows["O2"]), rows["O2"]
    else:
        assert re.match(r"O2\s+unavailable: .+", rows["O2"])
    assert not amp_patch.is_initialized()


def test_modes_flag_and_bad_arguments(capsys):
    assert demo.main(SMALL + ["--modes", "fp32"]) == 0
    assert list(_rows(capsys.readouterr().out)) == ["FP32"]
    assert demo.main(["--modes", "O7"]) == 2
    assert "--modes takes a comma-separated subset of FP32,O1,O2; got 'O7'" in capsys.readouterr().err
    assert demo.main(["--size", "0"]) == 2
    assert "--size must be at least 1" in capsys.readouterr().err
    assert demo.main(["--help"]) == 0
    assert "--full" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    assert demo.main(["--device", "cuda"]) == 2
    assert "no CUDA device is available; use --device cpu" in capsys.readouterr().err


def test_full_flag_selects_the_tutorials_sizes():
    args = demo._parser().parse_args(["--full"])
    assert args.full
    assert demo.FULL == dict(size=4096, batch_size=512, batches=50, epochs=5)


def test_peak_memory_counts_live_tensor_storage():
    base = {1: 100}  # a storage that exists before: counted, never freed by the step
    with demo._LiveTensors(base) as live:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B
        v = b.view(20, 25)  # a view: no new storage
        del a
        c = torch.empty(2000)  # 8000 B
        del b, v
    assert live.peak == 100 + 2000 + 8000
    assert live.current == 100 + 8000
    del c


def test_progress_bar_plain(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    bar = demo._Progress(4, "O1", enabled=True)
    for _ in range(2):
        bar.update()
    err = capsys.readouterr().err
    assert err.endswith("\r   O1 [" + "#" * 15 + "." * 15 + "] 2/4")
    bar.close()


@pytest.mark.slow
def test_demo_through_python_dash_m():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "demo", "--size", "16", "--batch-size", "8", "--batches", "2",
         "--epochs", "1", "--warmup", "0", "--modes", "FP32,O1", "--no-progress"],
        cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\nFP32\s+[\d.]+ ms\s+1\.00x .*linear x3 float32", proc.stdout)
    assert re.search(r"\nO1\s+[\d.]+ ms\s+[\d.]+x .*linear x3 bfloat16", proc.stdout)


@pytest.mark.parametrize("native", [True, False])
def test_demo_explains_a_cpu_without_bf16_instructions(native, capsys, monkeypatch):
    """Where BF16 is emulated the demo says, once, why O1/O2 are slower, instead of
    one warning per mode; where it is native it says nothing of the kind."""
    monkeypatch.setattr(amp_patch.diagnostics.setup_checks, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(amp_patch.diagnostics.notices, "_warned", set())  # warnings said earlier in the session
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert demo.main(SMALL + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    no_bf16 = [w for w in caught if "without native BF16" in str(w.message)]
    assert no_bf16 == []
    if native:
        assert "no BF16 instructions" not in out
    else:
        lines = out.splitlines()
        assert lines[1].startswith("Note: This CPU has no BF16 instructions (AVX512_BF16, AMX or Arm BF16)")
        assert lines[1].endswith("Expect O1 and O2 to be slower than FP32 in this run.")
        assert "The speedup needs a CPU that has them" in out
        assert set(_rows(out)) == {"FP32", "O1", "O2"}
