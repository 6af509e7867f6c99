#!/usr/bin/env bash
# One device call: make the llama-8b-shape checkpoint on the GPU, run the suite, then
# pdserve serve + pdserve bench serve. Writes JSON and logs under $OUT.
#   device run (carry .whl):  bash benchmarks/run_gpu.sh [suite sections] [attention backend]
set -uo pipefail
sections="${1:-limits,throughput,decode,prefill}"
backend="${2:-torch}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ck=/tmp/llama-8b
if [ ! -f $ck/config.json ]; then
  t0=$(date +%s)
  pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck --device cuda >/dev/null || exit 1
  echo "checkpoint written in $(( $(date +%s) - t0 ))s"
fi
if [ "$sections" != "none" ]; then
  timeout "${SUITE_TIMEOUT:-330}" python3 benchmarks/gpu_suite.py --ckpt $ck --out "$OUT/gpu_suite.json" --sections "$sections" \
    --attention-backend "$backend" 2>&1 | tee "$OUT/gpu_suite.log" | grep -v "^20..-" || true
fi
if [ "${SERVE:-1}" = "1" ]; then
  port=8011
  pdserve serve $ck --dtype bfloat16 --port $port --served-model-name llama-8b-shape \
    --max-model-len 4096 --attention-backend "$backend" --uvicorn-log-level warning >"$OUT/serve.log" 2>&1 &
  srv=$!
  t0=$(date +%s.%N)
  for _ in $(seq 1 1500); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.2; done
  echo "server ready after $(python3 -c "print(round($(date +%s.%N)-$t0,1))")s"
  grep -E "engine ready|captured" "$OUT/serve.log" | tail -2
  common=(--base-url http://127.0.0.1:$port --model llama-8b-shape --tokenizer $ck --dataset-name random
          --random-input-len 1024 --random-output-len 128 --disable-tqdm)
  echo "== first request after start-up (warm start)"
  pdserve bench serve "${common[@]}" --num-prompts 1 --seed 11 2>&1 | grep -E "Mean TTFT|Mean TPOT"
  echo "== steady state, one request at a time"
  pdserve bench serve "${common[@]}" --num-prompts 8 --max-concurrency 1 --seed 12 2>&1 | grep -E "Mean TTFT|Median TTFT|Mean TPOT"
  pdserve bench serve --base-url http://127.0.0.1:$port --model llama-8b-shape --tokenizer $ck \
    --dataset-name random --random-input-len 1024 --random-output-len 128 --num-prompts 500 \
    --request-rate inf --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --disable-tqdm --save-result --result-dir "$OUT" --result-filename bench_serve.json 2>&1 | tail -40
  curl -s localhost:$port/metrics | grep -E "^pdserve:(forward_steps|num_preemptions|prefix_cache)" > "$OUT/serve_metrics.txt"
  cat "$OUT/serve_metrics.txt"
  kill -TERM $srv; wait $srv; echo "server exit code $?"
fi
