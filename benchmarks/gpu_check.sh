#!/usr/bin/env bash
# The device check: one script, under 10 minutes on one GPU, everything under $OUT.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh            # Apex beside it: APEX_DIR=path/with/apex
#
# 1. the CUDA tests (tests/test_cuda.py and every test marked cuda), log in cuda_tests.log;
# 2. the paired GPU benchmark (benchmarks/suite.py on the GPT-style and ResNet-style
#    workloads: FP32, torch.autocast + GradScaler, O1, O2, O2 fused_update, O2 with the skip
#    decided on the host (O2-synced) and with torch's fused SGD (O2-fusedopt: no host sync a
#    step, tests/test_cuda.py's set_sync_debug_mode("error") test proves it), O3 and, where an
#    Apex checkout is given, apex.amp O1/O2), CUDA-event times, peak memory, host syncs per
#    step, in bench.md;
# 3. a profiler diff of O1 against autocast on the GPT-style workload: the aten ops and CUDA
#    kernels whose calls or bytes differ, with their time, in op_diff_O1.md;
# 4. `amp-patch demo` on the GPU (FP32, O1, O2 on the tutorial's SimpleNet), in demo.txt;
#    the CUDA tests of step 1 include Apex's stand-ins (FusedAdam, FusedLAMB, the fused
#    norms, the xentropy loss, amp_C) against their CPU results;
# 5. versions, device and driver in env.txt.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print('device', torch.cuda.get_device_name())"
  "$PY" -c "import wrapt, yaml; print('wrapt', wrapt.__version__, 'pyyaml', yaml.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# the optional C fast path, built for this Python (falls back to pure Python if it fails)
"$PY" setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 || echo "C fast path did not build; pure-Python wrappers" | tee -a "$OUT/build.txt"

echo "== CUDA tests"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m cuda tests -W ignore::DeprecationWarning 2>&1 \
  | tee "$OUT/cuda_tests.log" | tail -25

echo "== GPU benchmark"
modes="fp32 autocast O1 O2 O2-fused O2-synced O2-fusedopt O3"
if [ -n "${APEX_DIR:-}" ] && [ -d "$APEX_DIR/apex/amp" ]; then
  export PYTHONPATH="$PYTHONPATH:$APEX_DIR"
  modes="$modes apex-O1 apex-O2"
fi
timeout "${BENCH_TIMEOUT:-220}" "$PY" benchmarks/suite.py --device cuda --workloads gpt resnet --modes $modes \
  --rounds "${ROUNDS:-6}" --block-seconds 0.5 --output "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log" | tail -30

echo "== O1 against autocast, op by op"
timeout 60 "$PY" benchmarks/op_diff.py --device cuda --workload gpt --modes autocast O1 \
  > "$OUT/op_diff_O1.md" 2>&1; tail -40 "$OUT/op_diff_O1.md"

echo "== amp-patch demo on the GPU"
timeout 90 "$PY" -m amp_patch demo --device cuda --no-progress > "$OUT/demo.txt" 2>&1; tail -25 "$OUT/demo.txt"
echo "== done"
