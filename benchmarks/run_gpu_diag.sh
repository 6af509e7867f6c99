#!/usr/bin/env bash
# Second device call: first-request phases, decode host/device split, cuda_ipc transfer.
#   device run (carry .whl):  bash benchmarks/run_gpu_diag.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
ck=/tmp/llama-8b
[ -f $ck/config.json ] || pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck --device cuda >/dev/null || exit 1
timeout 400 python3 benchmarks/gpu_diag.py --ckpt $ck --out "$OUT/gpu_diag.json" "$@" 2>&1 | grep -vE "^20..-|Loading weights"
