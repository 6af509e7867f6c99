#!/usr/bin/env bash
# Device call for speculative decoding (issue 14): the GPU tests of spec decoding, then
# benchmarks/spec_bench.py under a timeout; JSON and log under $OUT.
#   device run (carry [".whl"]):  PDSERVE_COMMIT=<sha> bash benchmarks/run_spec.sh [sections]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -p no:cacheprovider -q -x tests/engine/test_speculative.py \
  -k cuda 2>&1 | tail -5
timeout "${SPEC_TIMEOUT:-420}" python3 benchmarks/spec_bench.py --out "$OUT/spec.json" \
  --sections "${1:-pd,curve}" 2>&1 | tee "$OUT/spec.log" | grep -vE "^20..-|Loading weights"
