#!/usr/bin/env bash
# The checks that need a GPU, as one command on a machine that has one, with its own torch
# built for CUDA (no environment is made: torch 2.13's pinned wheel here is a CPU build):
#   bash scripts/device_check.sh [OUT_DIR]
# 1. tests/test_cuda.py: memory really given back (torch.cuda.memory_allocated), no
#    host-device synchronisation in a tracked step (torch.cuda.set_sync_debug_mode("error"));
# 2. the small transformer's steps on the GPU, each timer read after torch.cuda.synchronize()
#    (benchmarks.overhead --device cuda --parts transformer_cuda), its table in OUT_DIR.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${1:-$ROOT/device-check}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else 'no CUDA device here')"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_benchmarks.py -k "cuda" 2>&1 \
    | tee "$OUT/tests.txt"
"$PY" -m benchmarks.overhead --device cuda --parts transformer_cuda --no-scaling | tee "$OUT/overhead_cuda.md"
