#!/usr/bin/env bash
# Device call for the GLM-5 family (issue 13): benchmarks/glm5_bench.py under a timeout,
# its JSON and log under $OUT.
#   device run (carry [".whl"]):  bash benchmarks/run_glm5.sh [sections] [presets] [extra flags]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "${GLM_TIMEOUT:-540}" python3 benchmarks/glm5_bench.py --out "$OUT/glm5.json" \
  --sections "${1:-accuracy,speed}" --presets "${2:-glm5-s4-e16,glm5-m12-e64}" "${@:3}" 2>&1 \
  | tee "$OUT/glm5.log" | grep -vE "^20..-|Loading weights|UNEXPECTED|^model\.layers|LOAD REPORT|^Key |^-+\+|^Notes|^- "
