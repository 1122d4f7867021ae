"""The demo: the tutorial's SimpleNet in FP32, O1 and O2, and its table."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch.frontends import demo

SMALL = ["--size", "32", "--batch-size", "8", "--batches", "2", "--steps", "4", "--rounds", "2", "--warmup", "1",
         "--no-progress"]


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


@pytest.mark.quick
def test_demo_prints_the_comparison_table(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == ("amp_patch demo: SimpleNet (3 x Linear 32->32, ReLU), MSE loss, Adam; batch 8, "
                        "4 timed steps after 1 warm-up; cpu (CPU half dtype: bfloat16)")
    assert lines[1] == f"Hardware: {demo.hardware(torch.device('cpu'))}"
    assert lines[2].startswith("Measured: each mode in its own process, 1 thread (--threads), timed by its CPU "
                               "time; modes interleaved in 2 rounds, medians ± spread over rounds")
    rows = _rows(out)
    assert list(rows) == ["FP32", "O1", "O2"]
    # the O2 row is the default O2, whose step is the one-pass kernel where it is built
    built = amp_patch.precision.kernel.native is not None
    for mode in ("O1", "O2"):  # 1 + 4 timed + the memory probe
        assert (f"{mode}'s optimizer step (the default, no option): one pass in C per parameter for 6 of 6 steps" in out) is built

    f = re.match(r"FP32\s+[\d.]+ ms ±\d+%\s+1\.00x\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+linear x3 float32, relu x2 float32, loss float32$",
                 rows["FP32"])
    assert f, rows["FP32"]
    first, last = _fp32_reference_losses()
    assert float(f.group(1)) == pytest.approx(first, abs=1e-4) and float(f.group(2)) == pytest.approx(last, abs=1e-4)
    assert last < first  # the column shows the network learning

    m = re.match(r"O1\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+%\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+(.*)$", rows["O1"])
    assert m, rows["O1"]
    assert m.group(3) == "linear x3 bfloat16, relu x2 bfloat16, loss float32"
    assert float(m.group(2)) == pytest.approx(last, rel=0.05)  # BF16 trains the same net
    assert float(m.group(2)) < float(m.group(1))

    if _o2_available():
        assert re.match(r"O2\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+%\s+[\d.]+ -> [\d.]+\s+[\d.]+ MiB\s+linear x3 bfloat16",
                        rows["O2"]), rows["O2"]
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
    assert demo.main(["--steps", "3", "--rounds", "5"]) == 2
    assert "--rounds 5 is more than --steps 3: each round needs a step per mode" in capsys.readouterr().err
    assert demo.main(["--warmup", "0"]) == 2
    assert "--warmup must be at least 1" in capsys.readouterr().err
    assert demo.main(["--help"]) == 0
    assert "--full" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    assert demo.main(["--device", "cuda"]) == 2
    assert "no CUDA device is available; use --device cpu" in capsys.readouterr().err


def test_full_flag_selects_the_tutorials_sizes_and_steps():
    args, modes, _ = demo._settings(["--full"])
    assert (args.size, args.batch_size, args.batches, args.steps, args.rounds) == (4096, 512, 50, 250, 10)
    assert args.steps == 5 * args.batches  # the tutorial's 5 epochs
    assert args.progress and modes == ["FP32", "O1", "O2"] and args.threads == 1


def test_default_sizes_follow_the_device(monkeypatch):
    args, _, device = demo._settings(["--device", "cpu"])
    assert (device.type, args.size, args.batch_size, args.threads) == ("cpu", 1024, 256, 1)
    # a GPU gets the tutorial's sizes: at the CPU's, per-op overheads hide the speedup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args, _, device = demo._settings([])
    assert (device.type, args.size, args.batch_size) == ("cuda", 4096, 512)
    args, _, _ = demo._settings(["--size", "64"])
    assert (args.size, args.batch_size) == (64, 512)


def test_full_says_how_long_it_will_take_and_shows_progress(capsys, monkeypatch):
    monkeypatch.setattr(demo, "FULL", dict(size=16, batch_size=8, batches=2, steps=4, rounds=2))
    assert demo.main(["--full", "--modes", "FP32,O1", "--warmup", "1"]) == 0
    captured = capsys.readouterr()
    estimate = next(line for line in captured.out.splitlines() if line.startswith("Timed part:"))
    assert re.fullmatch(r"Timed part: 4 steps per mode in 2 rounds, about \d+ s \(from the warm-up's step times: "
                        r"FP32 \d+ ms, O1 \d+ ms\)", estimate), estimate
    assert captured.out.index("Timed part:") < captured.out.index("\nmode ")  # up front, before the table
    rounds = captured.err.splitlines()
    assert re.fullmatch(r"round 1/2: FP32 [\d.]+ ms, O1 [\d.]+ ms; about \d+ s left", rounds[0]), rounds
    assert re.fullmatch(r"round 2/2: FP32 [\d.]+ ms, O1 [\d.]+ ms", rounds[1]), rounds


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


@pytest.mark.quick
def test_spread_is_half_the_interquartile_range_over_the_median():
    assert demo.spread([2.0]) == 0.0
    assert demo.spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert demo.spread([0.9, 1.0, 1.0, 1.1]) == pytest.approx((1.025 - 0.975) / 2)  # quartiles 0.975, 1.025
    assert demo.spread([1, 2, 3, 4, 5, 6, 7]) == pytest.approx((5.5 - 2.5) / 2 / 4)


@pytest.mark.quick
def test_noise_verdict_from_given_timings():
    steady = {"O1": [1.50, 1.52, 1.48, 1.51, 1.49, 1.50, 1.53], "O2": [2.0, 2.1, 1.95, 2.05, 2.0, 2.02, 1.98]}
    assert demo.noise_verdict(steady, load=0.4, cores=2) == []
    assert demo.noise_verdict(steady, load=None, cores=2) == []  # no load average on this platform
    # the five O1 runs, as if they were rounds of one run: ±38% around 0.88x
    swinging = {"O1": [0.41, 3.09, 0.87, 0.88, 1.45], "O2": [2.0, 2.0, 2.0, 2.0, 2.0]}
    assert demo.noise_verdict(swinging, load=0.4, cores=2) == [
        f"O1's speedup varies ±{demo.spread(swinging['O1']):.0%} over 5 rounds (more than ±10%)"]
    assert demo.noise_verdict(steady, load=3.5, cores=2) == [
        "the load average was 3.5 on 2 cores before the demo started: other work shares the machine"]
    assert len(demo.noise_verdict(swinging, load=2.5, cores=2)) == 2
    assert demo.noise_verdict(steady, load=0.1, cores=2, threshold=0.005)  # a stricter bar


def test_noise_verdict_is_printed_after_the_table(capsys, monkeypatch):
    monkeypatch.setattr(demo, "_load", lambda: 64.0)
    assert demo.main(SMALL + ["--modes", "FP32,O1"]) == 0
    out = capsys.readouterr().out
    assert "load average 64.0 on" in out.splitlines()[2]
    verdict = out[out.index("\nToo noisy to trust these figures: "):]
    assert "the load average was 64.0 on" in verdict and "Run it again on an idle machine" in verdict


CPUINFO = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 {}\n\n"


@pytest.mark.parametrize("flags,says", [
    ("avx512f amx_tile amx_bf16 avx512_bf16", "BF16 matrix units: amx_bf16 (AMX tiles)"),
    ("avx512f avx512_bf16", "BF16: avx512_bf16, no amx_bf16: native BF16 dot products in vector registers, no matrix units"),
    ("avx512f", "BF16: none of amx_bf16, avx512_bf16: torch emulates BF16 here, slower than FP32"),
])
@pytest.mark.quick
def test_hardware_line_reads_the_bf16_flags(flags, says):
    info = CPUINFO.format(flags)
    assert demo.cpu_bf16_flags(info) == [f for f in ("amx_bf16", "avx512_bf16") if f in flags.split()]
    line = demo.hardware(torch.device("cpu"), info)
    assert line.startswith(f"Test CPU 9000, {os.cpu_count()} cores; ") and says in line


def test_unavailable_mode_is_a_row_not_a_crash(capsys, monkeypatch):
    real = demo.Trainer.__init__

    def refuse(self, mode, config, device):
        if mode == "O2":
            raise amp_patch.ConfigError("O2 needs something this machine lacks")
        real(self, mode, config, device)

    monkeypatch.setattr(demo.Trainer, "__init__", refuse)  # the forked workers inherit it
    assert demo.main(SMALL) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["O2"].split() == ["O2", "unavailable:", "O2", "needs", "something", "this", "machine", "lacks"]
    assert rows["O1"].startswith("O1 ")


@pytest.mark.slow
def test_demo_through_python_dash_m():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "demo", "--size", "16", "--batch-size", "8", "--batches", "2",
         "--steps", "2", "--rounds", "2", "--warmup", "1", "--modes", "FP32,O1", "--no-progress"],
        cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\nFP32\s+[\d.]+ ms ±\d+%\s+1\.00x .*linear x3 float32", proc.stdout)
    assert re.search(r"\nO1\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+% .*linear x3 bfloat16", proc.stdout)


@pytest.mark.parametrize("native", [True, False])
def test_demo_explains_a_cpu_without_bf16_instructions(native, capsys, monkeypatch):
    """Where BF16 is emulated the demo says, once, why O1/O2 are slower (its
    workers drop the per-mode warning); where it is native it says nothing of the kind."""
    monkeypatch.setattr(amp_patch.diagnostics.setup_checks, "cpu_has_native_bf16", lambda: native)
    assert demo.main(SMALL + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    if native:
        assert "no BF16 instructions" not in out
    else:
        lines = out.splitlines()
        assert lines[3].startswith("Note: This CPU has no BF16 instructions (AVX512_BF16, AMX or Arm BF16)")
        assert lines[3].endswith("Expect O1 and O2 to be slower than FP32 in this run.")
        assert "The speedup needs a CPU that has them" in out
        assert set(_rows(out)) == {"FP32", "O1", "O2"}
