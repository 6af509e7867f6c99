#!/usr/bin/env bash
# One device call for issue 5's suite: installs the carried wheels, makes the
# llama-8b-shape checkpoint on the GPU (about 25 s), runs benchmarks/gpu_suite.py (all
# sections by default: limits, peer, serve, throughput, decode, prefill) and leaves
# gpu_suite.json, gpu_suite.log and the servers' logs (serve_0..2/) under $OUT.
#   device run (carry [".whl"]):  PDSERVE_COMMIT=<sha> bash benchmarks/run_gpu.sh [sections] [attention backend]
#   (PDSERVE_COMMIT: the commit to record; the device copy of the tree may carry a stale .git)
#   SERVE_ARGS="--async-scheduling": extra flags for the serve section's server
#   SERVE_STARTS=5: fresh server starts whose first requests give the warm-start median
set -uo pipefail
sections="${1:-limits,peer,serve,throughput,decode,prefill}"
backend="${2:-auto}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ck=/tmp/llama-8b
if [ ! -f $ck/config.json ]; then
  t0=$(date +%s)
  pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck --device cuda >/dev/null || exit 1
  echo "checkpoint written in $(( $(date +%s) - t0 ))s"
fi
timeout "${SUITE_TIMEOUT:-480}" python3 benchmarks/gpu_suite.py --ckpt $ck --out "$OUT/gpu_suite.json" \
  --sections "$sections" --attention-backend "$backend" --serve-args="${SERVE_ARGS:-}" --serve-starts "${SERVE_STARTS:-3}" 2>&1 | tee "$OUT/gpu_suite.log" | grep -vE "^20..-|Loading weights"
