#!/usr/bin/env bash
# The GPU acceptance runs still open (issues 15, 17, 18, 19, 20, 21), in device calls of
# at most 10 minutes each; every stage prints its tables and leaves JSON and logs under
# $OUT. Record the commit yourself: the device copy of the tree may carry a stale .git.
#
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh a
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh b
#   device run (carry [".whl-nixl"]):  bash benchmarks/run_pending.sh nixl-install
#   device run (carry [".whl"], same warm machine):  bash benchmarks/run_pending.sh nixl
#   device run (carry [".whl"]):       bash benchmarks/run_pending.sh glm5      (then glm5-sla)
#   nvidia-h200-x2 (carry [".whl"]):   bash benchmarks/run_pending.sh x2
#   nvidia-h200-x4/-x8 (carry [".whl"]): bash benchmarks/run_pending.sh dpep 4   (or 8)
#
# ab1, ab2  the same runs as a and b in two calls: ab1 runs the GPU tests and the bf16
#       quality gate side by side (correctness only), then structured_bench (on drawn
#       weights) and transfer_bench alone; ab2 runs fp8_bench and glm5_kernels_bench.
# s9    structured_bench (deferred masks against land-first), the GLM-5 decode profile at
#       1x1K and 32x1K (--long: graphs at two context widths), an FP8 GEMM sweep of
#       down_proj at 1/16/64 tokens, then the GPU tests that changed (about 7 minutes).
# a     GPU-marked tests of the kernels, layers, KV transfer and engine (parity of every
#       Triton kernel against its torch reference on the device; issues 15, 19, 20, 21),
#       then benchmarks/fp8_bench.py (issue 19: FP8 decode against the FP8 roofline,
#       prefill against the FP8 matmul peak, offline throughput next to bf16).
# b     benchmarks/glm5_kernels_bench.py (issue 15 and the FP8 MoE of issue 19),
#       benchmarks/transfer_bench.py over cuda_ipc (issue 20), tools/demo_gate.py at bf16
#       with the top-2 gaps at each divergence (issue 18), and
#       benchmarks/structured_bench.py (issue 17: JSON schema at batch 64 against none).
# glm5  benchmarks/glm5_bench.py speed on glm5-m12-e64 (issue 15): decode at batch 1/32
#       x 1K/16K and 8 x 128K against the roofline with graph steps counted, a 16K
#       prefill, transformers' GlmMoeDsaForCausalLM on the same preset.
# glm5-sla  `pdserve bench sla` of glm5-m12-e64 at 16384/1000 (issue 15's serve target).
# nixl  transfer_bench over cuda_ipc and nixl with the 1P1D-over-nixl equality, then a
#       1P1D nixl serve run at 16384/1000 (issue 20): transfer failures and leases left.
# x2    two GPUs (issue 21): cuda_ipc across GPUs (test and transfer time against the
#       peer copy bound), then `pdserve bench sla --compare` of 1P1D (a GPU each) against
#       two colocated replicas behind the proxy and one TP2 instance, 16384/1000.
# dpep  N GPUs (issue 21): the glm5-m12-e64 preset served with --data-parallel-size N
#       --enable-expert-parallel against one GPU, the same closed-loop load per rank
#       (32 streams per GPU, 1024 in / 256 out): output tok/s per GPU and mean TPOT.
set -uo pipefail
stage="${1:?usage: run_pending.sh s9|ab1|ab2|a|b|glm5|glm5-sla|nixl-install|nixl|x2|dpep N}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/gpu-env
echo "commit ${PDSERVE_COMMIT:-unknown} stage $stage"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { grep -vE "^20..-|Loading weights|UNEXPECTED|LOAD REPORT"; }
ck=/tmp/llama-8b
cfg8b=/tmp/llama-8b-config  # config and tokenizer only: weights drawn at load
llama_config() {
  [ -f $cfg8b/config.json ] || pdserve make-checkpoint --arch LlamaForCausalLM \
    --preset llama-8b-shape --out $cfg8b --config-only >/dev/null
}
llama_ckpt() {
  if [ ! -f $ck/config.json ]; then
    pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck \
      --device cuda >/dev/null || return 1
  fi
}

# The tests that use the GPU: every kernel test (they run on CUDA when it is there,
# compiled, rather than in Triton's interpreter) and the gpu-marked tests elsewhere.
gpu_tests() {
  timeout "$1" python3 -m pytest -p no:cacheprovider tests/kernels
  timeout "$1" python3 -m pytest -p no:cacheprovider -m gpu tests/kv_transfer tests/engine \
    tests/models
}

glm5_config() {  # glm5-m12-e64's weights (53 GB) do not fit the disk: drawn at load
  [ -f "$1/config.json" ] || pdserve make-checkpoint --arch GlmMoeDsaForCausalLM \
    --preset glm5-m12-e64 --out "$1" --config-only >/dev/null || exit 1
}

case "$stage" in
  ab1)  # one call: the correctness runs side by side, then the timed ones alone
    gpu_tests 270 > "$OUT/gpu_tests.log" 2>&1 &
    tests=$!
    timeout 240 python3 tools/demo_gate.py --device cuda --dtype bfloat16 --num-prompts 32 \
      --max-new-tokens 64 --json "$OUT/gate-bf16.json" > "$OUT/gate.log" 2>&1 &
    gate=$!
    llama_config
    wait $tests; tail -25 "$OUT/gpu_tests.log"
    wait $gate; quiet < "$OUT/gate.log" | tail -40
    timeout 150 python3 benchmarks/structured_bench.py --ckpt $cfg8b --load-format dummy \
      --out "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | quiet
    timeout 120 python3 benchmarks/transfer_bench.py --transports cuda_ipc --no-equality \
      --out "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.log" | quiet
    ;;
  s9)  # session 9's last call: what changed after runs 33-37, most wanted first
    llama_config
    timeout 100 python3 benchmarks/structured_bench.py --ckpt $cfg8b --load-format dummy \
      --out "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | quiet | tail -7
    timeout 80 python3 benchmarks/glm5_bench.py --out "$OUT/glm5_profile.json" \
      --presets glm5-m12-e64 --long --profile 1x1024,32x1024 2>&1 | tee "$OUT/glm5_profile.log" \
      | quiet | tail -60
    timeout 60 python3 benchmarks/fp8_gemm_sweep.py --out "$OUT/fp8_gemm_sweep.json" \
      --shapes down --tokens 1,16,64 --budget-s 45 2>&1 | tee "$OUT/fp8_gemm_sweep.log" | tail -30
    timeout 100 python3 -m pytest -p no:cacheprovider -m gpu tests/kv_transfer tests/engine \
      tests/models 2>&1 | tail -8
    timeout 120 python3 -m pytest -p no:cacheprovider tests/kernels/test_graph_widths.py \
      tests/kernels/test_dsa_indexer.py tests/kernels/test_sparse_mla.py \
      tests/kernels/test_fused_moe.py tests/kernels/test_fp8.py 2>&1 | tail -8
    ;;
  ab2)
    timeout 300 python3 benchmarks/fp8_bench.py --out "$OUT/fp8_bench.json" 2>&1 \
      | tee "$OUT/fp8_bench.log" | quiet
    timeout 200 python3 benchmarks/glm5_kernels_bench.py --out "$OUT/glm5_kernels.json" 2>&1 \
      | tee "$OUT/glm5_kernels.log" | quiet
    ;;
  a)
    gpu_tests 240 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
    timeout 300 python3 benchmarks/fp8_bench.py --out "$OUT/fp8_bench.json" 2>&1 \
      | tee "$OUT/fp8_bench.log" | quiet
    ;;
  b)
    timeout 150 python3 benchmarks/glm5_kernels_bench.py --out "$OUT/glm5_kernels.json" 2>&1 \
      | tee "$OUT/glm5_kernels.log" | quiet
    timeout 120 python3 benchmarks/transfer_bench.py --transports cuda_ipc --no-equality \
      --out "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.log" | quiet
    timeout 150 python3 tools/demo_gate.py --device cuda --dtype bfloat16 --num-prompts 32 \
      --max-new-tokens 64 --json "$OUT/gate-bf16.json" 2>&1 | tee "$OUT/gate.log" | quiet
    llama_ckpt && timeout 120 python3 benchmarks/structured_bench.py --ckpt $ck \
      --out "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" | quiet
    ;;
  glm5)
    GLM_TIMEOUT=560 bash benchmarks/run_glm5.sh speed glm5-m12-e64 --long
    ;;
  glm5-sla)
    g=/tmp/glm5-m12-e64
    glm5_config $g
    pdserve serve $g --host 127.0.0.1 --port 8000 --load-format dummy \
      --max-model-len 17500 > "$OUT/glm5_server.log" 2>&1 &
    server=$!
    timeout 540 python3 -m pdserve.cli bench sla --base-url http://127.0.0.1:8000 --model $g \
      --random-input-len 16384 --random-output-len 1000 --num-prompts 32 --num-warmups 1 \
      --start 0.5 --tolerance 0.2 --sla-ttft-ms 2500 --sla-tpot-ms 20 --num-gpus 1 \
      --ready-check-timeout-sec 300 --disable-tqdm --result-dir "$OUT" \
      --result-filename glm5-sla-16384-1000.json 2>&1 | quiet
    curl -s http://127.0.0.1:8000/metrics | grep -E "^pdserve:(forward_steps_total|num_requests_running)"
    kill $server; wait $server 2>/dev/null
    ;;
  nixl-install)
    python3 -c "import nixl; print('nixl', nixl.__file__)"
    ;;
  nixl)
    timeout 200 python3 benchmarks/transfer_bench.py --transports cuda_ipc,nixl \
      --out "$OUT/transfer_nixl.json" 2>&1 | tee "$OUT/transfer_nixl.log" | quiet
    llama_ckpt && timeout 330 python3 benchmarks/pd_bench.py --ckpt $ck --device 0 \
      --topologies pd --transport nixl --input-len 16384 --output-len 1000 --rates 0.5 \
      --num-prompts 16 --log-dir "$OUT/pd_nixl_logs" \
      --out "$OUT/pd_nixl.json" 2>&1 | tee "$OUT/pd_nixl.log" | quiet
    ;;
  x2)
    timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu \
      tests/kv_transfer/test_transports.py 2>&1 | tail -5
    timeout 120 python3 benchmarks/transfer_bench.py --device cuda:0 --prefill-device cuda:1 \
      --transports cuda_ipc,tcp --no-equality --out "$OUT/transfer_x2.json" 2>&1 | quiet
    llama_ckpt && timeout 420 python3 benchmarks/pd_bench.py --ckpt $ck --device 0,1 \
      --prefill-device 0 --decode-device 1 --topologies pd,replicas,tp --sla \
      --num-prompts 24 --log-dir "$OUT/x2_logs" --out "$OUT/x2_sla.json" 2>&1 | quiet
    ;;
  dpep)
    n="${2:?dpep needs the GPU count}"
    g=/tmp/glm5-m12-e64
    glm5_config $g
    for ranks in 1 "$n"; do
      dp=(); [ "$ranks" -gt 1 ] && dp=(--data-parallel-size "$ranks" --enable-expert-parallel)
      pdserve serve $g --host 127.0.0.1 --port 8000 --load-format dummy "${dp[@]}" \
        > "$OUT/dpep$ranks.log" 2>&1 &
      server=$!
      timeout 280 python3 -m pdserve.cli bench serve --base-url http://127.0.0.1:8000 --model $g \
        --random-input-len 1024 --random-output-len 256 --max-concurrency $((32 * ranks)) \
        --num-prompts $((96 * ranks)) --ready-check-timeout-sec 240 --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "dpep$ranks.json" 2>&1 | quiet \
        | grep -E "throughput|TPOT|TTFT|Successful"
      curl -s http://127.0.0.1:8000/metrics | grep -E "^pdserve:forward_steps_total" | head -8
      kill $server; wait $server 2>/dev/null
    done
    ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac
exit 0
