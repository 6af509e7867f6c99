#!/usr/bin/env bash
# One device call for issue 16's H200 acceptance: `pdserve bench sla` capacity of the
# llama-8b-shape checkpoint (full-vocabulary tokenizer, so random prompts share no
# prefix) served colocated on one GPU, at 1024/128 and at 16384/1000, against mean
# TTFT <= 2.5 s and mean TPOT <= 20 ms. Leaves the two search JSONs, their PNGs, the
# server log and a final /metrics scrape under $OUT.
#   device run (carry [".whl"]):  PDSERVE_COMMIT=<sha> bash benchmarks/run_sla.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
echo "commit ${PDSERVE_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ck=/tmp/llama-8b
if [ ! -f $ck/config.json ]; then
  t0=$(date +%s)
  pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck --device cuda >/dev/null || exit 1
  echo "checkpoint written in $(( $(date +%s) - t0 ))s"
fi
pdserve serve $ck --host 127.0.0.1 --port 8000 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
server=$!
common=(--base-url http://127.0.0.1:8000 --model $ck --ignore-eos --ready-check-timeout-sec 300
        --result-dir "$OUT" --sla-ttft-ms 2500 --sla-tpot-ms 20 --num-gpus 1 --disable-tqdm)
timeout "${T_SHORT:-200}" python3 -m pdserve.cli bench sla "${common[@]}" --random-input-len 1024 --random-output-len 128 \
  --num-prompts 300 --num-warmups 4 --start 16 --tolerance 0.1 --result-filename sla-1024-128.json
timeout "${T_LONG:-330}" python3 -m pdserve.cli bench sla "${common[@]}" --random-input-len 16384 --random-output-len 1000 \
  --num-prompts 32 --num-warmups 1 --start 0.5 --tolerance 0.2 --result-filename sla-16384-1000.json
curl -s http://127.0.0.1:8000/metrics > "$OUT/metrics.txt"
grep -E "^pdserve:(forward_steps_total|prefix_cache_(queries|hits)_total)" "$OUT/metrics.txt"
kill $server; wait $server 2>/dev/null
exit 0
