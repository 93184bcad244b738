#!/usr/bin/env bash
# GPU check: every `gpu`-marked test and a short engine benchmark on a fresh CUDA host with no internet, in
# under 8 minutes, ending with one summary line. Run from the repository root of a copy of the tree:
#   scripts/gpu_wheels.sh          # here, once (PyPI reachable): gpu-wheels/ for the GPU host's Python
#   make gpu-check                 # there, with gpu-wheels/ carried beside the tree
# Uses the host's own Python, torch and triton (the device image's python3 is itself a venv, so a venv made from it
# would not see them) and installs only scripts/gpu_requirements.txt from the wheels into a folder on PYTHONPATH
# (--no-index --no-deps: nothing is fetched; their own dependencies are in the image). Writes the pytest report
# and the benchmark's log under ${OUT:-/tmp/gpu-check}. Exit status: 0 when the tests passed and the benchmark ran.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
wheels=${GPU_WHEELS:-gpu-wheels}
site=${GPU_SITE:-/tmp/deepinfer-gpu-site}
python=${PYTHON:-python3}
t0=$(date +%s)
say() { echo "[gpu-check $(( $(date +%s) - t0 ))s] $*"; }

say "host: $($python -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")' 2>&1)"
if ! $python -m pip install -q --upgrade --no-index --no-deps --target "$site" --find-links "$wheels" -r scripts/gpu_requirements.txt; then
  echo "GPU CHECK: FAILED (install from $wheels: run scripts/gpu_wheels.sh and carry the folder)"; exit 2
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
py=$python
"$py" -c 'import gguf, nats, pytest_asyncio, yaml, tqdm' || { echo "GPU CHECK: FAILED (a dependency is missing)"; exit 2; }
command -v nats-server > /dev/null || { echo "GPU CHECK: FAILED (no nats-server binary from the wheel)"; exit 2; }
# GPU_CHECK_ON_CPU=1 runs the same steps without a device (checks this script: every gpu test skips)
[ "${GPU_CHECK_ON_CPU:-0}" = 1 ] || "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "GPU CHECK: FAILED (torch sees no CUDA device)"; exit 2; }

# 1. Every gpu-marked test: Triton kernels vs their torch references, CUDA graphs replay token-exact, the CUDA IPC
#    hand-off between two processes, device-resident KV hand-off. Warnings are shown, not errors (-W default):
#    the host's torch is not the one CI pins.
say "gpu-marked tests"
timeout 300 "$py" -m pytest -q -p no:cacheprovider -m gpu -W default --timeout 240 \
  tests/gpu tests/unit/test_decode_graphs.py tests/integration/test_kv_device_handoff.py \
  tests/integration/test_kv_transports.py --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}
summary=$(grep -E "passed|failed|error|skipped" "$out/gpu-tests.log" | tail -1)

# 2. A short engine benchmark on a random checkpoint of SmolLM2-135M's shape (no model download on the host).
say "engine benchmark"
model="$out/smollm2-shaped"
"$py" - "$model" <<'PY' || { echo "GPU CHECK: FAILED (checkpoint)"; exit 2; }
import sys
import torch
from tests.model_factory import write_tiny_hf_folder
write_tiny_hf_folder(sys.argv[1], seed=0, dtype=torch.bfloat16, num_layers=30, hidden=576, heads=9, kv_heads=3,
                     ffn=1536, vocab=49152, tie=True, max_position_embeddings=8192)
PY
timeout 240 "$py" -m benchmarks.gpu_engine --model "$model" --dtype bfloat16 --new-tokens 64 --repeat 1 \
  2>&1 | tee "$out/gpu-bench.log" | tail -12
bench_rc=${PIPESTATUS[0]}
decode64=$(grep -E "decode batch  64, graphs auto" "$out/gpu-bench.log" | grep -oE "[0-9.]+ out tok/s" | head -1)
prefill=$(grep -E "^prefill" "$out/gpu-bench.log" | grep -oE "[0-9.]+ prompt tok/s" | head -1)
graphs=$(grep -E "decode batch  64: graphs" "$out/gpu-bench.log" | sed 's/.*graphs \/ eager = //')

status=OK; [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] || status=FAILED
# on a GPU host every one of those tests must have run: a skip there means a path went unchecked
[ "${GPU_CHECK_ON_CPU:-0}" = 1 ] || ! grep -qE "[0-9]+ skipped" <<< "$summary" || status=FAILED
echo "GPU CHECK: $status in $(( $(date +%s) - t0 )) s | tests: ${summary:-none ran} | decode b64: ${decode64:-n/a}, graphs/eager ${graphs:-n/a} | prefill: ${prefill:-n/a}"
[ "$status" = OK ]
