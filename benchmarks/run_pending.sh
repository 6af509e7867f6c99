#!/usr/bin/env bash
# The GPU acceptance runs still open (issues 15, 17, 18, 19, 20, 21, 29), in device calls
# of at most 10 minutes each; every stage prints its tables and leaves JSON and logs under
# $OUT. Record the commit yourself: the device copy of the tree may carry a stale .git.
# Two stages in one call: `export RUN_START=$(date +%s); bash ... A; bash ... B` (B's
# deadlines then count from the call's start).
#
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh d10 (first), g18, f11g, xfer
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh s12|fp8s|moe|moe8|pdl|xfer
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh k10
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh p10
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh glm5-sla [mtp]
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh d10
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh c11   (first)
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh f11
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh f11g
#   device run (carry [".whl", ".baseline"]): PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh r11
#                                      (first, here: scripts/make-baseline b8c8bd7)
#   device run (carry [".whl", ".baseline"]): PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh r11g
#   device run (carry [".whl", ".baseline"]): PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh r11all (both, one round)
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh gpu1
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh gpu2
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh a
#   device run (carry [".whl"]):       PDSERVE_COMMIT=<sha> bash benchmarks/run_pending.sh b
#   device run (carry [".whl", ".whl-nixl"]):  bash benchmarks/run_pending.sh nixl
#                                      (first, here: scripts/fetch-wheels --nixl)
#   device run (carry [".whl"]):       bash benchmarks/run_pending.sh glm5      (then glm5-sla)
#   nvidia-h200-x2 (carry [".whl", ".whl-nixl"]):   bash benchmarks/run_pending.sh x2
#   nvidia-h200-x4/-x8 (carry [".whl"]): bash benchmarks/run_pending.sh dpep 4   (or 8)
#
# s12   the Gluon sparse MLA prefill kernel's parity on the GPU (kernels/sparse_mla_gluon.py,
#       never run yet) and the Triton variants'; benchmarks/prefill_sweep.py --sections
#       mla_variants (the variants of kernels/sparse_mla_prefill.py and the Gluon kernel
#       against the general kernel at 16K/4K/2K; benchmarks/pick_mla_variant.py names the
#       best), then glm5_bench prefill 16K/64K with the default, the sweep's pick and the
#       general kernel only, then the GPU tests fixed after run 40.
# g15   session 15's first call: the defaults' and Gluon FP8 tests, the 16K gather bound, fp8_gemm_compare (run 49).
# g15b  the defaults' tests with time enough, then fp8_bench llama-8b-shape with the TMA FP8
#       kernel on for 1,024+ token batches.
# g15c  the warp-specialized MLA kernel (gluon_ws): parity, the 16K sweep, glm5 prefill 16K
#       with it, then the defaults' tests (run 50).
# g15e  glm5 prefill 16K / 64K with gluon_ws the default, then the MoE sweep (down_n tiles) (run 51).
# g16   the select variants (benchmarks/select_bench.py: the K-th key by bits or by byte
#       histograms) with their GPU parity, glm5 prefill 16K / 64K with the faster (it becomes
#       the default when it wins by 3%+; the profiles carry scope diagnostics for the 64K
#       categories), then glm5_bench --sections accuracy (issue 26).
# g17   issue 26 with session 17's tree, for an H200 (session 17 had H100s only): glm5
#       prefill 16K in one 16K step (the issue's measurement) and in 8K steps, 64K, then
#       the accuracy gate.
# f16   decode attention over an fp8 cache beside bf16 (kernels_bench --kv-dtype fp8) and its
#       tile sweep, then fp8_bench llama-8b-shape with its new profiles (issue 28).
# f18   decode attention over an fp8 cache with fp16 MMAs and in-layout tile conversion
#       (FP8_HALF) beside bf16 MMAs, its tile sweep, fp8_bench llama-8b-shape (issue 28).
# g14   the Gluon kernels of session 13 (kernels/sparse_mla_gluon.py,
#       kernels/fp8_gemm_gluon.py): the MLA kernel's GPU parity, then glm5 prefill on it,
#       then the FP8 / PDL / MoE GPU tests and the mla_variants sweep and
#       fp8_gemm_compare.py in the time left (RESULTS.md run 46).
# pdl   programmatic dependent launch (PDSERVE_PDL=0 / 1: every decode-path Triton kernel may
#       launch while its predecessor finishes, kernels/_utils.pdl_args): glm5-m12-e64
#       decode speed with it off and on in one call, then the 1 x 1K profile with it on
#       (kernels per step, idle time in the replay). Keep it (make it the default) only
#       if it helps (issue 30).
# moe   benchmarks/prefill_sweep.py --sections moe: the fused MoE's tiles, now with the
#       grouped program order (row blocks sweep the column tiles together), 512-16K tokens.
# moe8  glm5_kernels_bench.py --sections moe_fp8: the FP8 fused MoE beside bf16 at 1-4096
#       tokens, and at prefill sizes its 128-row, 16-warp tiles beside _fp8_config's, a
#       pre-quantized x (the model's FP8 path) and the grouped program order
# fp8s  the Gluon FP8 GEMMs' parity on the GPU (kernels/fp8_gemm_gluon.py, never run yet),
#       benchmarks/fp8_gemm_compare.py (Triton, Gluon, bf16 cuBLAS at 1/16/64 rows against
#       the copy rate; + Triton 128x128 tiles and torch._scaled_mm at 2K-16K tokens
#       against the fp8 peak), then
#       benchmarks/fp8_gemm_sweep.py down/gate_up at 64 and 8,192 tokens (issue 28).
# c30   one call for issues 29 and 30: transfer_bench over nixl, llama decode with the
#       skinny GEMM on and off, then the 1P1D nixl serve run in the time left.
# s34   SDPA's prefill kernels (flash / cuDNN, GQA), r11 (the tree against .baseline),
#       then f35
# b35   by card: c32 on an H200, else f35
# f37   fp8_bench llama-8b-shape (offline timed warm), then glm5-m12-e64
# b37   by card: c32 on an H200, else f37
# b38   by card: h31 on an H200, else f37
# f39   issue 28: glm5 decode 32 x 16K profiled, bf16 then FP8 (glm5_bench --fp8)
# p39   issue 26: glm5 16K prefill, the MLA share against the burst and the sustained matmul rate
# m39   issue 27: decode-only concurrency within 20 ms at 200 / 208 x 16K: none, k=1, k=3 adaptive
#       (neighbouring sizes' measured costs) at 0.7, 256 tokens a stream
# x39   issue 30: the split top-k select (kernels/dsa_select_split.py, never run on a GPU): its
#       parity, select_bench's decode cases, then glm5 decode at 1 x 1K / 16K with it on (8 rows)
#       and off
# s38   issue 30: glm5 decode at 1 x 1K / 16K with its linears on cuBLAS, then on the decode-size GEMM
# f38   issue 28: decode attention configs at 16K over fp8 and bf16 caches; the select at 1 x 16K in a 32K buffer
# v38   issue 27: the indexer's verify tile with keys as the MMA's rows (parity, sweep, MTP decode)
# h31   issue 30's bars on an H200 (llama decode, glm5 b1 decode + profile), then glm5 16K prefill
# f35   llama-8b-shape bf16 beside FP8 (fp8_bench) on the defaults, then FP8 with the
#       prompt's attention on FlashAttention (PDSERVE_SDPA_PREFILL=flash)
# b33   by card: c32 on an H200, else fp8w
# fp8w  issue 28: the warp-specialized FP8 prefill GEMM's GPU parity, its prefill GEMMs
#       beside the TMA kernel, llama-8b-shape FP8 with PDSERVE_FP8_PREFILL=ws and =tma
# k35   issues 28, 30: the skinny GEMM's FP8 word path and swapped tile on the GPU, FP8
#       llama with the decode-size GEMM off / one row / 64 rows, the quick sweep
# x36   r11 (an experiment branch against .baseline), then k35 in the time left
# b32   by card: c32 on an H200, else k34
# k34   issue 30: the skinny GEMM's tests, its layer section, r11's llama pair (.baseline)
# c32   by card: on an H200 llama decode on the defaults and off, glm5 16K prefill, decode
#       streams at 192 x 16K (issues 30, 26, 27); elsewhere the decode attention configs
# k33   issues 30, 28: llama-8b-shape decode on the defaults, then FP8 with the decode-size
#       GEMM off and on
# k32   issue 30: the skinny GEMM's tests, its layer section with PDL and early weight
#       loads, and llama-8b-shape decode with it off / on / with PDL
# k31   issue 30: the skinny GEMM's GPU tests, then its quick sweep (no FP8) at K31_ROWS
#       (default 1,16: the rows it runs at by default)
# b31   by card: h30 on an H200, else k31
# c31   on an H200 issue 26's glm5 16K prefill first; then k31 on any card
# a31   by card: h30 on an H200, else issue 29's nixl serve run and the quick skinny sweep
# h30   on an H200: glm5 16K prefill (issue 26's MLA share) and decode streams within
#       20 ms at 192-224 x 16K, none and adaptive k=3 (issue 27).
# s30f  issue 28: fp8_bench llama-8b-shape with the skinny GEMM off, then on; its GPU tests.
# s30   issue 30: the skinny GEMM's GPU parity and bench, then llama-8b-shape decode with
#       it off / at the default rows / to 64 rows / with PDL (gpu_suite decode).
# skinny  issue 30: benchmarks/skinny_bench.py (the decode-size GEMM and its prologues
#       beside cuBLAS and today's launches, llama-8b-shape projections at 1/16/64 rows).
# xfer  the early copy's order (read sent first, the launch flushed) and the block-copy
#       kernel shapes: transfer_bench --variants / --copy-shapes (issue 29).
# k10   the GLM-5 prefill / verify kernels (issues 26, 27), most wanted first: their parity
#       tests compiled on CUDA (sparse MLA with the wide shape, the tiled indexer and the
#       register select, the fused MoE, graph widths, the Triton GLM-5 model), then
#       benchmarks/prefill_sweep.py (sparse MLA launch shapes at prefill 2K/4K/16K, verify
#       and decode at 64-256 x 16K; fused MoE at 512-16K tokens; TFLOP/s against the
#       matmul rate of the call) and glm5_kernels_bench.py indexer_prefill,indexer_verify
#       (tiled scores and selects). The best configs become the kernels' defaults.
# p10   benchmarks/glm5_bench.py on glm5-m12-e64 with --long (issue 26): the prefill
#       section (4K / 16K / 64K: tok/s, TFLOP/s by kernel category against the matmul
#       rate), decode speed against the roofline, the accuracy gate (glm5-s4-e16, KL to
#       transformers fp32 against transformers' own bf16), transformers' prefill and decode.
# d10   benchmarks/spec_bench.py decode (issue 27): TPOT by streams 1-256 x 16K for no
#       speculation and MTP k=1/k=3 at synthetic 0.5/0.7/0.9, with the step roofline.
#       D10_ROWS=128 D10_VARIANT=gluon: decode/verify steps of 128+ rows take candidate rows
#       + that prefill kernel (mla_triton.ROWS_MIN_TOKENS), if the mla_variants sweep's
#       decode/verify rows say it wins there.
# c11   before any speed run: session 11's CUDA paths compiled and checked (the request
#       state's post_update/place kernels run in every engine step on CUDA; the fp8
#       activation producers, the fp8 indexer keys, the 16-byte block copy), then the
#       gpu-marked engine, runner and KV-transfer tests.
# f11   FP8 (issue 28) and KV transfer (issue 29): the new kernels' parity compiled on CUDA
#       (fp8 activations from the norm / SiLU-and-mul, the FP8 GEMM reading them, the FP8
#       MoE, the fp8 indexer-key cache), fp8_bench on llama-8b-shape (bf16 beside FP8:
#       decode against the roofline, prefill against the FP8 matmul rate, offline),
#       glm5_kernels_bench indexer_fp8 (bf16 keys beside fp8 keys), the block-copy test and
#       transfer_bench over cuda_ipc (the copy started before the read's reply).
# f11g  fp8_bench on glm5-m12-e64 (bf16 beside FP8; decode 1/32 x 1K/16K, prefill 8K/16K).
# r11, r11g  issue 31's "no speed lost": the same decode points run by the tree before the
#       step-machinery redesign (.baseline/src and its benchmarks/, made by scripts/make-baseline) and by this
#       one, two rounds in one call, the second in the other order (A B B A): r11
#       llama-8b-shape at batch 1/16/64 x 1K (gpu_suite decode, sync and async), r11g
#       glm5-m12-e64 at 1 and 32 x 1K/16K (glm5_bench speed); benchmarks/pair_compare.py
#       prints each point's medians and current / baseline (the bar: <= 1.02).
# gpu1, gpu2  every GPU test and the whole gpu_suite in two calls (issue 29), one pytest
#       process per test module (a device-side assert fails only its own module), each
#       under a timeout, until the call's deadline; each call prints a table first (per
#       module: status, passed, failed, errors, skipped, seconds; then every failed test),
#       and leaves the table in $OUT/gpu1_tests.json / gpu2_tests.json
#       (benchmarks/pytest_table.py), each module's log and JUnit XML in
#       $OUT/gpu1_tests_logs.tgz / gpu2_tests_logs.tgz. gpu1: every
#       module of tests/kernels (they run on CUDA, compiled, where it is there). gpu2: the
#       `-m gpu` tests of every other folder (kv_transfer, engine, models, and any that
#       come), found by one collection pass; modules importing `openai` are left out where
#       it is not installed (listed as not run), a module that fails to collect is listed
#       as such; then benchmarks/gpu_suite.py, all sections, on llama-8b-shape (its table
#       last; gpu_suite.json and .log under $OUT).
# ab1, ab2  the same runs as a and b in two calls: ab1 runs the GPU tests and the bf16
#       quality gate side by side (correctness only), then structured_bench (on drawn
#       weights) and transfer_bench alone; ab2 runs fp8_bench and glm5_kernels_bench.
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
# glm5-sla  `pdserve bench sla` of glm5-m12-e64 at 16384/1000 (issue 26's serve target:
#       48 prompts a point); `glm5-sla mtp` serves it with MTP k=3 at synthetic acceptance
#       0.7.
# nixl  transfer_bench over cuda_ipc and nixl with the 1P1D-over-nixl equality, then a
#       1P1D nixl serve run at 16384/1000 (issue 20): transfer failures and leases left.
# x2    two GPUs (issue 21): cuda_ipc across GPUs (test and transfer time against the
#       peer copy bound), then `pdserve bench sla --compare` of 1P1D (a GPU each) against
#       two colocated replicas behind the proxy and one TP2 instance, 16384/1000.
# dpep  N GPUs (issue 21): the glm5-m12-e64 preset served with --data-parallel-size N
#       --enable-expert-parallel against one GPU, the same closed-loop load per rank
#       (32 streams per GPU, 1024 in / 256 out): output tok/s per GPU and mean TPOT.
set -uo pipefail
stage="${1:?usage: run_pending.sh b37|f37|b35|f35|s34|b33|fp8w|k35|x36|b32|k34|c32|k33|k32|c31|b31|k31|a31|c30|h30|s30|s30f|skinny|pdl2|h31|g18|g16|g17|f16|f17|f18|p30|g15|g15b|g15c|g15e|g14|s12|fp8s|moe|moe8|pdl|xfer|k10|p10|d10|c11|f11|f11g|r11|r11g|r11all|gpu1|gpu2|ab1|ab2|a|b|glm5|glm5-sla [mtp]|nixl|x2|dpep N}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# RUN_START (epoch seconds): where two stages share one call, export it once before both,
# so the second one's deadlines count from the call's start, not its own
start=${RUN_START:-$(date +%s)}
# the device returns at most 8 files: at the end of a stage that left more than 6 loose
# ones (its JSON, logs, per-module files), they go into one archive (pack_<stage>.tgz);
# earlier archives stay as they are
pack_out() {
  local list=/tmp/pack_out.list
  (cd "$OUT" && find . -type f ! -name '*.tgz' > $list
   [ "$(wc -l < $list)" -gt 6 ] || exit 0
   tar czf "pack_${stage}.tgz" -T $list && xargs rm -f < $list && find . -type d -empty -delete
   echo "(\$OUT: $(wc -l < $list) files packed into pack_${stage}.tgz)")
}
trap pack_out EXIT
source scripts/gpu-env
echo "commit ${PDSERVE_COMMIT:-unknown} stage $stage"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { grep -vE "^20..-|Loading weights|UNEXPECTED|LOAD REPORT"; }
# glm5_prefill SECONDS TAG LENS [glm5_bench args]: glm5-m12-e64 prefill into $OUT/glm5_prefill_TAG.*
glm5_prefill() {
  local secs=$1 tag=$2 lens=$3; shift 3
  timeout "$secs" python3 benchmarks/glm5_bench.py --sections prefill --presets glm5-m12-e64 \
    --no-peer --long --prefill-lens "$lens" --workdir /tmp/glm5 "$@" \
    --out "$OUT/glm5_prefill_$tag.json" > "$OUT/glm5_prefill_$tag.log" 2>&1
  echo "glm5 prefill $tag: exit $?"; quiet < "$OUT/glm5_prefill_$tag.log" | tail -14
}
# glm5_decode SECONDS TAG [VAR=VALUE ...]: glm5-m12-e64 decode at 1 x 1K / 16K against the
# roofline, with the profile (kernels a step, idle in the replay), into $OUT/glm5_TAG.*
glm5_decode() {
  local secs=$1 tag=$2; shift 2
  env "$@" timeout "$secs" python3 benchmarks/glm5_bench.py --sections speed,profile \
    --presets glm5-m12-e64 --long --no-peer --workdir /tmp/glm5 --profile 1x1024,1x16384 \
    --out "$OUT/glm5_$tag.json" > "$OUT/glm5_$tag.log" 2>&1
  echo "glm5 decode $tag $*: exit $?"; quiet < "$OUT/glm5_$tag.log" | tail -24
}
# glm5_accuracy: the accuracy gate (glm5-s4-e16) if a minute is left of the call's ~575 s
glm5_accuracy() {
  local t=$(( start + 575 - $(date +%s) ))
  [ "$t" -gt 60 ] || { echo "accuracy: skipped, ${t}s left"; return; }
  timeout "$t" python3 benchmarks/glm5_bench.py --sections accuracy --presets glm5-s4-e16 \
    --workdir /tmp/glm5 --out "$OUT/glm5_accuracy.json" > "$OUT/glm5_accuracy.log" 2>&1
  echo "accuracy: exit $?"; quiet < "$OUT/glm5_accuracy.log" | tail -3
}
ck=/tmp/llama-8b
# fp8_llama_skinny: FP8 llama-8b-shape (fp8_bench) with the decode-size GEMM off, then on
fp8_llama_skinny() {
  local rows
  for rows in ${FP8_SKINNY_ROWS:-0 16}; do
    PDSERVE_SKINNY_ROWS=$rows timeout 160 \
      python3 benchmarks/fp8_bench.py --models llama-8b-shape --variants fp8 \
      --out "$OUT/s30f_rows$rows.json" > "$OUT/s30f_rows$rows.log" 2>&1
    echo "fp8 llama, skinny rows $rows: exit $?"; quiet < "$OUT/s30f_rows$rows.log" | sed -n '/^== /,$p'
  done
}
# llama_decode ROWS PDL END MIN: gpu_suite's llama-8b-shape decode with PDSERVE_SKINNY_ROWS
# and PDSERVE_PDL set (- leaves one unset: the model's default), if MIN seconds are left
# before END
llama_decode() {
  local rows=$1 pdl=$2 left=$(( start + $3 - $(date +%s) )) tag=s30_rows$1_pdl$2 env=()
  [ "$left" -gt "$4" ] || return 1
  [ "$rows" = - ] || env+=(PDSERVE_SKINNY_ROWS=$rows)
  [ "$pdl" = - ] || env+=(PDSERVE_PDL=$pdl)
  env ${env[@]+"${env[@]}"} timeout $(( left < 110 ? left : 110 )) \
    python3 benchmarks/gpu_suite.py --ckpt $ck --sections decode --batches 1,16,64 \
    --contexts 1024 --out "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1
  echo "decode, skinny rows $rows, PDL $pdl: exit $?"; sed -n '/^ batch /,/^batch /p' "$OUT/$tag.log"
}
cfg8b=/tmp/llama-8b-config  # config and tokenizer only: weights drawn at load
llama_config() {
  [ -f $cfg8b/config.json ] || pdserve make-checkpoint --arch LlamaForCausalLM \
    --preset llama-8b-shape --out $cfg8b --config-only >/dev/null
}
# r11_run llama|glm5 baseline|current ROUND: one decode run of issue 31's speed check by
# that tree's own script and src (.baseline/ from scripts/make-baseline). R11_PIN=CPUS runs
# each process on those cores only (taskset): runs 95-96's synchronous steps were bimodal
# in both trees, the host's share 0.4 or 0.85 ms at batch 1 from one process to the next
r11_run() {
  local root=. name="r11_$2_$3" pin=()
  [ "$2" = baseline ] && root=.baseline
  [ -n "${R11_PIN:-}" ] && pin=(taskset -c "$R11_PIN")
  if [ "$1" = llama ]; then
    PYTHONPATH="/tmp/site:$PWD/$root/src" timeout 110 ${pin[@]+"${pin[@]}"} \
      python3 $root/benchmarks/gpu_suite.py \
      --ckpt $ck --sections decode --batches 1,16,64 --contexts 1024 --attention-backend auto \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  else
    name="r11g_$2_$3"
    PYTHONPATH="/tmp/site:$PWD/$root/src" timeout 140 ${pin[@]+"${pin[@]}"} \
      python3 $root/benchmarks/glm5_bench.py \
      --sections speed --presets glm5-m12-e64 --no-peer --workdir /tmp/glm5 \
      --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  fi
  echo "$1 $2 round $3: exit $? (src $(PYTHONPATH="/tmp/site:$PWD/$root/src" python3 -c \
    'import pdserve; print(pdserve.__file__)'))"
  if [ "$1" = llama ]; then sed -n '/^== /,/^batch /p' "$OUT/$name.log"
  else quiet < "$OUT/$name.log" | tail -8; fi
}

llama_ckpt() {
  if [ ! -f $ck/config.json ]; then
    pdserve make-checkpoint --arch LlamaForCausalLM --preset llama-8b-shape --out $ck \
      --device cuda >/dev/null || return 1
  fi
}
# on_h200: whether this call's card is an H200 (stages that pick their runs by card)
on_h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
# nixl_serve SECONDS: the 1P1D nixl serve run at 16384/1000 (issue 29) into $OUT/pd_nixl.*
nixl_serve() {
  llama_ckpt && timeout "$1" python3 benchmarks/pd_bench.py --ckpt $ck --device 0 \
    --topologies pd --transport nixl --input-len 16384 --output-len 1000 --rates 0.5 \
    --num-prompts 16 --log-dir "$OUT/pd_nixl_logs" \
    --out "$OUT/pd_nixl.json" 2>&1 | tee "$OUT/pd_nixl.log" | quiet
}

# The tests that use the GPU: every kernel test (they run on CUDA when it is there,
# compiled, rather than in Triton's interpreter) and the gpu-marked tests elsewhere.
gpu_tests() {
  timeout "$1" python3 -m pytest -p no:cacheprovider tests/kernels
  timeout "$1" python3 -m pytest -p no:cacheprovider -m gpu tests/kv_transfer tests/engine \
    tests/models
}

# One pytest process per module, each under a timeout of at most 240 s, until the
# deadline (epoch seconds, $1); writes $OUT/tests/<module>.log and .xml, and a manifest
# line per module (benchmarks/pytest_table.py's format) to $2. Outside tests/kernels only
# the gpu-marked tests of a module run.
module_tests() {
  local deadline=$1 manifest=$2 m base left rc t0 sel
  shift 2
  mkdir -p "$OUT/tests"
  for m in "$@"; do
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 30 ]; then
      printf '%s\t-\t-\t-\tout of time\n' "$m" >> "$manifest"
      continue
    fi
    base="$OUT/tests/$(basename "$(dirname "$m")")_$(basename "$m" .py)"
    sel=()
    [[ $m == tests/kernels/* ]] || sel=(-m gpu)
    t0=$(date +%s%N)
    timeout $(( left < 240 ? left : 240 )) python3 -m pytest -p no:cacheprovider -rfE \
      ${sel[@]+"${sel[@]}"} "$m" -o junit_family=xunit1 --junitxml="$base.xml" > "$base.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t\n' "$m" "$rc" "$base.xml" \
      "$(awk -v t="$(( $(date +%s%N) - t0 ))" 'BEGIN { printf "%.1f", t / 1e9 }')" >> "$manifest"
  done
}

# The modules outside tests/kernels holding gpu-marked tests, one a line, from one
# collection pass over tests/. Without `openai` its importers are left out, and they and
# any module that fails to collect get a manifest line in $1.
gpu_marked_modules() {
  local rows=$1 ignore=() f
  mkdir -p "$OUT/tests"
  if ! python3 -c "import openai" 2>/dev/null; then
    for f in $(grep -rlE "^(import openai|from openai)" tests --include='*.py' | sort); do
      ignore+=(--ignore="$f")
      printf '%s\t-\t-\t-\tneeds openai (not installed here)\n' "$f" >> "$rows"
    done
  fi
  python3 -m pytest -p no:cacheprovider --collect-only -q -m gpu tests --ignore=tests/kernels \
    ${ignore[@]+"${ignore[@]}"} > "$OUT/tests/collect.log" 2>&1
  local rc=$?
  grep -E '^ERROR tests/' "$OUT/tests/collect.log" | awk '{ print $2 }' | sort -u | while read -r f; do
    printf '%s\t2\t-\t-\tcollection error (tests/collect.log)\n' "$f" >> "$rows"
  done
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && ! grep -qE '^ERROR tests/' "$OUT/tests/collect.log"; then
    printf 'tests (collection pass)\t%s\t-\t-\tsee tests/collect.log\n' "$rc" >> "$rows"
  fi
  grep -oE '^tests/[^: ]+\.py(::|: [0-9]+$)' "$OUT/tests/collect.log" | sed -E 's/(::|: ).*//' \
    | sort -u
}

# Prints the table of a manifest and writes it as JSON ($2).
# test_table MANIFEST JSON: the pass/fail table; then each module's log and JUnit XML go
# into one archive beside the JSON (a call returns a limited number of files: run 86's
# call, gpu1 after d10, lost most of them)
test_table() {
  python3 benchmarks/pytest_table.py --manifest "$1" --json "$2"
  local logs="${2%.json}_logs.tgz"
  (cd "$OUT/tests" && tar czf "$logs" --remove-files -- *.log *.xml 2>/dev/null)
  echo "(logs and JUnit XML: $logs; table: $2)"
}

glm5_config() {  # glm5-m12-e64's weights (53 GB) do not fit the disk: drawn at load
  [ -f "$1/config.json" ] || pdserve make-checkpoint --arch GlmMoeDsaForCausalLM \
    --preset glm5-m12-e64 --out "$1" --config-only >/dev/null || exit 1
}

# The GPU tests of session 14's defaults (the Gluon MLA prefill kernel and its rows at
# 128+ decode rows, PDL on): the MTP graph steps and the kernels (more modules: "$@").
defaults_tests() {
  local t=$1; shift
  mkdir -p "$OUT/tests"
  timeout "$t" python3 -m pytest -p no:cacheprovider -q -rfE \
    "tests/engine/test_spec_step.py::test_uniform_verify_batches_replay_graphs" \
    "tests/engine/test_speculative.py::test_mtp_verify_and_draft_steps_replay_graphs_on_cuda" \
    tests/kernels/test_sparse_mla_gluon.py tests/kernels/test_pdl.py "$@" \
    > "$OUT/tests/defaults.log" 2>&1; echo "tests with the new defaults: exit $?"
  tail -6 "$OUT/tests/defaults.log"
}

# The Gluon FP8 GEMMs' GPU parity (both prefill tile kernels and the swapped one).
fp8_gluon_tests() {
  mkdir -p "$OUT/tests"
  timeout "$1" python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_fp8_gemm_gluon.py \
    > "$OUT/tests/fp8_gemm_gluon.log" 2>&1; echo "fp8 gluon tests: exit $?"
  tail -5 "$OUT/tests/fp8_gemm_gluon.log"
}

case "$stage" in
  k10)
    timeout 150 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_sparse_mla.py \
      tests/kernels/test_dsa_indexer.py tests/kernels/test_dsa_indexer_tiled.py \
      tests/kernels/test_fused_moe.py tests/kernels/test_graph_widths.py \
      tests/kernels/test_glm5_triton_model.py 2>&1 | tail -6
    timeout 270 python3 benchmarks/prefill_sweep.py --out "$OUT/prefill_sweep.json" \
      --budget-s 230 > "$OUT/prefill_sweep.log" 2>&1
    sed -n '/^== /,$p' "$OUT/prefill_sweep.log" || tail -20 "$OUT/prefill_sweep.log"
    left=$(( start + 575 - $(date +%s) ))
    timeout "$left" python3 benchmarks/glm5_kernels_bench.py --sections \
      indexer_prefill,indexer_verify --out "$OUT/indexer_sweep.json" 2>&1 \
      | tee "$OUT/indexer_sweep.log" | quiet | tail -40
    ;;
  p10)
    GLM_TIMEOUT=560 bash benchmarks/run_glm5.sh accuracy,speed,prefill glm5-m12-e64 --long
    ;;
  d10)  # D10_ROWS=N [D10_VARIANT=name]: decode/verify steps of N+ rows take that MLA kernel
    mt=src/pdserve/layers/attention/mla_triton.py
    if [ -n "${D10_ROWS:-}" ]; then
      sed -i "s/^ROWS_MIN_TOKENS: int | None = .*/ROWS_MIN_TOKENS: int | None = $D10_ROWS/" "$mt"
      [ -n "${D10_VARIANT:-}" ] && \
        sed -i "s/^PREFILL_VARIANT: str | None = .*/PREFILL_VARIANT: str | None = \"$D10_VARIANT\"/" "$mt"
      grep -n '^ROWS_MIN_TOKENS\|^PREFILL_VARIANT' "$mt"
    fi
    # D10_TIMEOUT: when it follows another stage in one call (r11 then d10: ~200 + ~350 s)
    timeout "${D10_TIMEOUT:-570}" python3 benchmarks/spec_bench.py --sections decode \
      --out "$OUT/spec_decode.json" \
      --profile-streams 128,192 > "$OUT/spec_decode.log" 2>&1
    quiet < "$OUT/spec_decode.log" | sed -n '/: decode at a/,$p'
    ;;
  c11)
    timeout 240 python3 -m pytest -p no:cacheprovider -q -rfE \
      tests/kernels/test_request_state_kernel.py tests/kernels/test_fp8_activation.py \
      tests/kernels/test_fp8.py tests/kernels/test_fused_moe_fp8.py tests/kernels/test_rmsnorm.py \
      tests/kernels/test_activation.py tests/kernels/test_dsa_indexer.py \
      tests/kernels/test_mla_prep.py tests/kv_transfer/test_block_copy.py 2>&1 | tail -20
    timeout 300 python3 -m pytest -p no:cacheprovider -q -rfE -m gpu tests/engine tests/runner \
      tests/kv_transfer 2>&1 | tail -20
    ;;
  s12)  # the sparse MLA prefill kernels, then glm5 prefill with the default and the sweep's pick
    end=$(( start + ${S12_END:-560} ))  # everything ends by then
    left() { echo $(( end - $(date +%s) )); }
    timeout 90 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_sparse_mla_gluon.py \
      tests/kernels/test_sparse_mla_prefill.py 2>&1 | tail -6
    t=$(left); [ "$t" -gt 110 ] && t=110
    timeout "$t" python3 benchmarks/prefill_sweep.py --sections mla_variants \
      --out "$OUT/mla_variants.json" --budget-s $(( t - 35 )) > "$OUT/mla_variants.log" 2>&1
    sed -n '/^== /,$p' "$OUT/mla_variants.log" | tail -30
    pick=$(python3 benchmarks/pick_mla_variant.py "$OUT/mla_variants.json")
    echo "the sweep's pick: ${pick:-none}"
    runs="default"; [ -n "$pick" ] && runs="default $pick"; runs="$runs general"
    mt=src/pdserve/layers/attention/mla_triton.py; cp "$mt" /tmp/mla_triton.py.orig
    for v in $runs; do  # general: PREFILL_VARIANT None (the general kernel only)
      [ "$(left)" -lt 150 ] && { echo "glm5 prefill, $v: no time left"; continue; }
      cp /tmp/mla_triton.py.orig "$mt"  # (the device's .git may be stale: no checkout)
      case "$v" in
        default) ;;
        general) sed -i 's/^PREFILL_VARIANT: str | None = .*/PREFILL_VARIANT: str | None = None/' "$mt" ;;
        *) sed -i "s/^PREFILL_VARIANT: str | None = .*/PREFILL_VARIANT: str | None = \"$v\"/" "$mt" ;;
      esac
      grep -n '^PREFILL_VARIANT' "$mt"
      glm5_prefill 150 "$v" 16384,65536
    done
    cp /tmp/mla_triton.py.orig "$mt"
    [ "$(left)" -gt 20 ] && timeout "$(left)" python3 -m pytest -p no:cacheprovider -q -rfE \
      "tests/engine/test_spec_step.py::test_uniform_verify_batches_replay_graphs" \
      "tests/engine/test_speculative.py::test_mtp_verify_and_draft_steps_replay_graphs_on_cuda" \
      tests/kernels/test_dsa_indexer.py tests/kernels/test_sparse_mla.py 2>&1 | tail -6
    ;;
  pdl)  # programmatic dependent launch (issue 30): glm5 decode with it off, then on; profile on
    for v in 0 1; do
      PDSERVE_PDL=$v timeout 200 python3 benchmarks/glm5_bench.py --sections speed \
        --presets glm5-m12-e64 --no-peer --workdir /tmp/glm5 --out "$OUT/glm5_speed_pdl$v.json" \
        > "$OUT/glm5_speed_pdl$v.log" 2>&1
      echo "PDSERVE_PDL=$v: exit $?"; quiet < "$OUT/glm5_speed_pdl$v.log" | tail -12
    done
    PDSERVE_PDL=1 timeout 150 python3 benchmarks/glm5_bench.py --presets glm5-m12-e64 \
      --profile 1x1024 --workdir /tmp/glm5 --out "$OUT/glm5_profile_pdl1.json" \
      > "$OUT/glm5_profile_pdl1.log" 2>&1
    quiet < "$OUT/glm5_profile_pdl1.log" | tail -12
    ;;
  g14)  # the Gluon kernels: if the MLA kernel's parity passes, glm5 prefill with it first
    end=$(( start + 580 )); left() { echo $(( end - $(date +%s) )); }
    timeout 120 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_sparse_mla_gluon.py \
      2>&1 | tail -8
    mla_rc=${PIPESTATUS[0]}; echo "gluon MLA parity: exit $mla_rc"
    mt=src/pdserve/layers/attention/mla_triton.py; cp "$mt" /tmp/mla_triton.py.orig
    if [ "$mla_rc" -eq 0 ]; then
      sed -i 's/^PREFILL_VARIANT: str | None = .*/PREFILL_VARIANT: str | None = "gluon"/' "$mt"
      grep -n '^PREFILL_VARIANT' "$mt"
      glm5_prefill 160 gluon 16384,65536
      cp /tmp/mla_triton.py.orig "$mt"
    fi
    timeout 120 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_fp8_gemm_gluon.py \
      tests/kernels/test_pdl.py tests/kernels/test_fused_moe.py 2>&1 | tail -8
    t=$(( $(left) / 2 )); [ "$t" -gt 130 ] && t=130
    [ "$t" -gt 50 ] && { timeout "$t" python3 benchmarks/prefill_sweep.py --sections mla_variants \
      --budget-s $(( t - 35 )) --out "$OUT/mla_variants_g14.json" > "$OUT/mla_variants_g14.log" 2>&1
      sed -n '/^== /,$p' "$OUT/mla_variants_g14.log" | tail -30; }
    t=$(left); [ "$t" -gt 50 ] && { timeout "$t" python3 benchmarks/fp8_gemm_compare.py \
      --budget-s $(( t - 35 )) --out "$OUT/fp8_gemm_compare_g14.json" \
      > "$OUT/fp8_gemm_compare_g14.log" 2>&1; sed -n '/^== /,$p' "$OUT/fp8_gemm_compare_g14.log"; }
    ;;
  g15)  # session 15's first call: the defaults' tests, the 16K gather bound, then fp8_gemm_compare (TMA kernel)
    end=$(( start + ${G15_END:-560} )); left() { echo $(( end - $(date +%s) )); }
    defaults_tests 110
    fp8_gluon_tests 60
    timeout 80 python3 benchmarks/prefill_sweep.py --sections mla_variants --budget-s 45 \
      --out "$OUT/mla_variants_gather.json" > "$OUT/mla_variants_gather.log" 2>&1
    sed -n '/^== /,$p' "$OUT/mla_variants_gather.log" | head -16
    t=$(left); [ "$t" -gt 60 ] && { timeout "$t" python3 benchmarks/fp8_gemm_compare.py \
      --budget-s $(( t - 35 )) --out "$OUT/fp8_gemm_compare.json" \
      > "$OUT/fp8_gemm_compare.log" 2>&1; sed -n '/^== /,$p' "$OUT/fp8_gemm_compare.log"; }
    ;;
  g15b)  # the new defaults' tests with time enough (each test's seconds), then FP8 with the
         # Gluon TMA kernel on for 1024+ token batches (layers/fp8.GLUON_MIN_TOKENS): llama-8b-shape
    mkdir -p "$OUT/tests"
    timeout 250 python3 -m pytest -p no:cacheprovider -v -rfE --durations=0 \
      "tests/engine/test_spec_step.py::test_uniform_verify_batches_replay_graphs" \
      "tests/engine/test_speculative.py::test_mtp_verify_and_draft_steps_replay_graphs_on_cuda" \
      tests/kernels/test_sparse_mla_gluon.py tests/kernels/test_pdl.py \
      tests/kernels/test_fp8_gemm_gluon.py > "$OUT/tests/defaults.log" 2>&1
    echo "tests with the new defaults: exit $?"
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|s call " "$OUT/tests/defaults.log" | tail -40
    timeout 230 python3 benchmarks/fp8_bench.py --models llama-8b-shape \
      --out "$OUT/fp8_llama.json" 2>&1 | tee "$OUT/fp8_llama.log" | quiet | tail -40
    ;;
  g15c)  # the warp-specialized MLA kernel (gluon_ws): parity, the 16K sweep, then the defaults' tests
    end=$(( start + ${G15C_END:-560} )); left() { echo $(( end - $(date +%s) )); }
    mkdir -p "$OUT/tests"
    timeout 100 python3 -m pytest -p no:cacheprovider -v -rfE tests/kernels/test_sparse_mla_gluon.py \
      > "$OUT/tests/mla_gluon.log" 2>&1; echo "gluon MLA parity (with gluon_ws): exit $?"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests/mla_gluon.log" | tail -16
    ws_rc=$(grep -cE "FAILED|ERROR" "$OUT/tests/mla_gluon.log")
    timeout 110 python3 benchmarks/prefill_sweep.py --sections mla_variants --budget-s 70 \
      --out "$OUT/mla_variants_ws.json" > "$OUT/mla_variants_ws.log" 2>&1
    sed -n '/^== /,$p' "$OUT/mla_variants_ws.log" | head -40
    if [ "$ws_rc" -eq 0 ] && grep -q "passed" "$OUT/tests/mla_gluon.log"; then
      mt=src/pdserve/layers/attention/mla_triton.py; cp "$mt" /tmp/mla_triton.py.orig
      sed -i 's/^PREFILL_VARIANT: str | None = .*/PREFILL_VARIANT: str | None = "gluon_ws"/' "$mt"
      glm5_prefill 120 ws 16384
      cp /tmp/mla_triton.py.orig "$mt"
    fi
    t=$(left); [ "$t" -gt 60 ] && { timeout "$t" python3 -m pytest -p no:cacheprovider -v -rfE \
      --durations=0 "tests/engine/test_spec_step.py::test_uniform_verify_batches_replay_graphs" \
      "tests/engine/test_speculative.py::test_mtp_verify_and_draft_steps_replay_graphs_on_cuda" \
      tests/kernels/test_pdl.py tests/kernels/test_fp8_gemm_gluon.py > "$OUT/tests/defaults.log" 2>&1
      echo "tests with the new defaults: exit $?"
      grep -E "PASSED|FAILED|ERROR|passed|failed|s call " "$OUT/tests/defaults.log" | tail -30; }
    ;;
  g16)  # session 16's additions: the select variants (K-th key by byte histograms) on the
        # GPU, glm5 prefill 16K with the faster one, then the accuracy gate (issue 26)
    timeout 150 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_dsa_indexer.py \
      tests/engine/test_draft_policy.py 2>&1 | tail -4
    timeout 180 python3 benchmarks/select_bench.py --out "$OUT/select.json" > "$OUT/select.log" 2>&1
    echo "select_bench: exit $?"; sed -n '/^== select/,$p' "$OUT/select.log"
    pick=$(python3 -c '
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["select"] if r["case"] == "prefill 16K" and r["exact"]]
ms = {r["variant"]: r["ms"] for r in rows}
print("hist" if ms.get("rows_hist", 1e9) < 0.97 * ms.get("rows_bits", 1e9) else "bits")' \
      "$OUT/select.json" 2>/dev/null || echo bits)
    echo "select pick: $pick"
    [ "$pick" = hist ] && sed -i 's/^REG_SELECT_HIST = False/REG_SELECT_HIST = True/' \
      src/pdserve/kernels/dsa_select.py
    glm5_prefill 220 16k_64k 16384,65536
    glm5_accuracy
    ;;
  g17)  # issue 26 on an H200 with session 17's tree (header)
    for b in 16384 8192; do glm5_prefill 200 "16k_b$b" 16384 --budget "$b"; done
    glm5_prefill 150 64k 65536
    glm5_accuracy
    ;;
  g18)  # session 18's probes: the sparse MLA kernel alone on one layer's operands of the
        # model's 16K prefill (mla_alone, issue 26), then the fused MoE at verify sizes (27)
    glm5_prefill 200 16k_b16384 16384 --budget 16384
    grep -h '"mla_alone"' "$OUT/glm5_prefill_16k_b16384.log"
    t=$(( start + 560 - $(date +%s) ))
    [ "$t" -gt 90 ] && { timeout "$t" python3 benchmarks/prefill_sweep.py --sections moe \
      --moe-tokens 512,1024,2048 --budget-s $(( t - 40 )) --out "$OUT/moe_verify.json" \
      > "$OUT/moe_verify.log" 2>&1; echo "moe sweep: exit $?"; grep -v '^{' "$OUT/moe_verify.log" | tail -40; }
    ;;
  f16)  # FP8 (issue 28): decode attention over an fp8 cache beside bf16, its tile sweep,
        # then fp8_bench llama-8b-shape (graph-timed GEMMs, the prefill and decode profiles)
    for kv in auto fp8; do
      timeout 90 python3 benchmarks/kernels_bench.py --sections decode --kv-dtype $kv \
        --out "$OUT/kernels_decode_$kv.json" 2>&1 | tail -8
    done
    timeout 200 python3 benchmarks/kernels_bench.py --sections decode_configs --kv-dtype fp8 \
      --out "$OUT/kernels_decode_configs_fp8.json" > "$OUT/kernels_decode_configs_fp8.log" 2>&1
    tail -12 "$OUT/kernels_decode_configs_fp8.log"
    t=$(( start + 575 - $(date +%s) ))
    [ "$t" -gt 90 ] && { timeout "$t" python3 benchmarks/fp8_bench.py --models llama-8b-shape \
      --out "$OUT/fp8_llama.json" > "$OUT/fp8_llama.log" 2>&1; echo "fp8_bench: exit $?"
      quiet < "$OUT/fp8_llama.log" | sed -n '/^== /,$p'; }
    ;;
  p30)  # issue 30: glm5-m12-e64 decode at batch 1 x 1K / 16K against the roofline with
        # the profile (kernels a step, idle inside the replay), PDL on, then off
    for pdl in ${P30_PDL-1 0}; do  # P30_PDL=1: the default only
      left=$(( start + 575 - $(date +%s) )); [ "$left" -gt 120 ] || break
      glm5_decode $(( left < 270 ? left : 270 )) "p30_pdl$pdl" PDSERVE_PDL=$pdl
    done
    ;;
  f18)  # FP8 (issue 28): decode attention over an fp8 cache with fp16 MMAs and the tiles
        # converted in their load layout (decode_attention.FP8_HALF) beside bf16 MMAs, its
        # tile sweep, then fp8_bench llama-8b-shape (F18_END: the call's end for it)
    timeout 90 python3 benchmarks/kernels_bench.py --sections decode --kv-dtype fp8 \
      --out "$OUT/kernels_decode_fp8.json" > "$OUT/kernels_decode_fp8.log" 2>&1
    echo "kernels_bench decode fp8: exit $?"; tail -8 "$OUT/kernels_decode_fp8.log"
    python3 -c "import json; [print(r['batch'], r['context'], r['splits'], r['fp8_half'], round(r['pct_roofline'], 1)) for r in json.load(open('$OUT/kernels_decode_fp8.json'))['decode']]"
    t=$(( start + ${F18_END:-575} - $(date +%s) - 100 ))
    [ "$t" -gt 60 ] && { timeout $(( t < 200 ? t : 200 )) python3 benchmarks/kernels_bench.py \
      --sections decode_configs --kv-dtype fp8 --out "$OUT/kernels_decode_configs_fp8.json" \
      > "$OUT/kernels_decode_configs_fp8.log" 2>&1; tail -4 "$OUT/kernels_decode_configs_fp8.log"; }
    t=$(( start + ${F18_END:-575} - $(date +%s) ))
    [ "$t" -gt 90 ] && { PDSERVE_PDL=0 timeout "$t" python3 benchmarks/fp8_bench.py \
      --models llama-8b-shape --variants fp8 --out "$OUT/fp8_llama.json" > "$OUT/fp8_llama.log" 2>&1
      echo "fp8_bench llama: exit $?"; quiet < "$OUT/fp8_llama.log" | sed -n '/^== /,$p'; }
    ;;
  f17)  # FP8 (issue 28): is the quantizing norm slow, or its PDL neighbours? (run 72: 42.8
        # ms of _rmsnorm_kernel in the 8K FP8 prefill after clip_waits, 7.9 ms of norms in
        # bf16): fp8_bench llama-8b-shape FP8 with PDL off, then on, then glm5 (f11g)
    # F17_PDL="": the glm5 part only; F17_END: when the call's ~575 s end for it (after h31).
    # First the block-FP8 GEMM's parity on the GPU (tests/kernels/test_fp8.py)
    timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8.py \
      > "$OUT/fp8_tests.log" 2>&1; echo "tests/kernels/test_fp8.py: exit $?"
    tail -n 3 "$OUT/fp8_tests.log"
    for pdl in ${F17_PDL-0 1}; do
      PDSERVE_PDL=$pdl timeout 200 python3 benchmarks/fp8_bench.py --models llama-8b-shape \
        --variants fp8 --out "$OUT/fp8_llama_pdl$pdl.json" > "$OUT/fp8_llama_pdl$pdl.log" 2>&1
      echo "fp8_bench PDSERVE_PDL=$pdl: exit $?"; quiet < "$OUT/fp8_llama_pdl$pdl.log" | sed -n '/^== /,$p'
    done
    t=$(( start + ${F17_END:-575} - $(date +%s) ))
    [ "$t" -gt 120 ] && { timeout "$t" python3 benchmarks/fp8_bench.py --models glm5-m12-e64 \
      --out "$OUT/fp8_glm5.json" > "$OUT/fp8_glm5.log" 2>&1; echo "fp8_bench glm5: exit $?"
      quiet < "$OUT/fp8_glm5.log" | sed -n '/^== /,$p'; }
    ;;
  g15e)  # glm5 prefill 16K/64K with gluon_ws the default, then the MoE tile sweep
    glm5_prefill 170 16k_64k 16384,65536
    t=$(( start + ${G15E_END:-400} - $(date +%s) ))
    [ "$t" -gt 60 ] && { timeout "$t" python3 benchmarks/prefill_sweep.py --sections moe \
      --budget-s $(( t - 30 )) --out "$OUT/moe_sweep.json" > "$OUT/moe_sweep.log" 2>&1
      sed -n '/^== /,$p' "$OUT/moe_sweep.log" | tail -40; }
    ;;
  moe8)  # the FP8 fused MoE beside the bf16 one, with 128-row FP8 tiles at prefill sizes
    timeout 150 python3 benchmarks/glm5_kernels_bench.py --sections moe_fp8 \
      --out "$OUT/moe_fp8.json" > "$OUT/moe_fp8.log" 2>&1
    echo "glm5_kernels_bench moe_fp8: exit $?"; quiet < "$OUT/moe_fp8.log" | tail -12
    ;;
  moe)  # the fused MoE's tiles and program order (grouped: MoeConfig.group_m) at 512-16K tokens
    timeout 170 python3 benchmarks/prefill_sweep.py --sections moe --budget-s 150 \
      --out "$OUT/moe_sweep.json" > "$OUT/moe_sweep.log" 2>&1
    sed -n '/^== /,$p' "$OUT/moe_sweep.log" | tail -40
    ;;
  fp8s)  # the FP8 GEMM at prefill size: the Gluon kernel beside the others, the tile sweep
    timeout 90 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_fp8_gemm_gluon.py \
      2>&1 | tail -4
    timeout 230 python3 benchmarks/fp8_gemm_compare.py --budget-s 190 \
      --out "$OUT/fp8_gemm_compare.json" > "$OUT/fp8_gemm_compare.log" 2>&1
    sed -n '/^== /,$p' "$OUT/fp8_gemm_compare.log"
    timeout 120 python3 benchmarks/fp8_gemm_sweep.py --shapes down,gate_up --tokens 64,8192 \
      --budget-s 90 --out "$OUT/fp8_gemm_sweep.json" > "$OUT/fp8_gemm_sweep.log" 2>&1
    tail -14 "$OUT/fp8_gemm_sweep.log"
    ;;
  fp8w)  # issue 28: the warp-specialized FP8 prefill GEMM (kernels/fp8_gemm_gluon_ws.py):
    # its GPU parity (a hang stops the stage), the prefill GEMMs beside the "tma" kernel,
    # then llama-8b-shape FP8 (fp8_bench) with PDSERVE_FP8_PREFILL=tma and =ws
    timeout 90 python3 -m pytest -p no:cacheprovider -q -rfE tests/kernels/test_fp8_gemm_gluon.py \
      -k "ws" 2>&1 | tail -4
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "ws parity failed: stage stopped"; exit 1; }
    timeout 150 python3 benchmarks/fp8_gemm_compare.py --prefill-only --budget-s 120 \
      --impls gluon_tma,gluon_ws,bf16 --out "$OUT/fp8_ws_compare.json" \
      > "$OUT/fp8_ws_compare.log" 2>&1
    sed -n '/^== /,$p' "$OUT/fp8_ws_compare.log"
    for kern in ws tma; do
      [ $(( start + ${FP8W_END:-570} - $(date +%s) )) -gt 150 ] || { echo "fp8 $kern: no time"; break; }
      PDSERVE_FP8_PREFILL=$kern timeout 160 python3 benchmarks/fp8_bench.py --models llama-8b-shape \
        --variants fp8 --out "$OUT/fp8w_$kern.json" > "$OUT/fp8w_$kern.log" 2>&1
      echo "fp8 llama, prefill kernel $kern: exit $?"; quiet < "$OUT/fp8w_$kern.log" | sed -n '/^== /,$p'
    done
    ;;
  skinny)  # issue 30: the decode-size GEMM (kernels/skinny_gemm.py) beside cuBLAS at the
    # llama-8b-shape projections x 1/16/64 rows, its config sweep, and its producer prologues
    # (add+RMSNorm, SiLU-and-mul) beside today's two launches
    timeout 540 python3 benchmarks/skinny_bench.py ${SKINNY_QUICK:+--quick} --fp8 \
      --out "$OUT/skinny.json" 2>&1 | tee "$OUT/skinny.log" | quiet | tail -60
    ;;
  c30)  # one call for issues 29 and 30 when machines are scarce: transfer_bench over
    # cuda_ipc / nixl:0 / nixl, llama-8b-shape decode (gpu_suite) with the decode-size GEMM
    # on (16 rows) and off, then the 1P1D nixl serve run in the time left
    python3 -c "from pdserve.kv_transfer.transports.nixl import load_nixl; print(load_nixl())" \
      || exit 1
    timeout 100 python3 benchmarks/transfer_bench.py --transports cuda_ipc,nixl:0,nixl \
      --out "$OUT/transfer_nixl.json" > "$OUT/transfer_nixl.log" 2>&1
    echo "transfer_bench: exit $?"; grep -vE "^\[[0-9.]+\] " "$OUT/transfer_nixl.log" | quiet
    llama_ckpt || exit 1
    for rows in 16 0; do llama_decode $rows 0 ${C30_END:-575} 60 || break; done
    left=$(( start + ${C30_END:-575} - $(date +%s) ))
    [ "$left" -gt 200 ] || { echo "1P1D nixl serve run: skipped, ${left}s left"; exit 0; }
    nixl_serve $left
    ;;
  s30f)  # issue 28: llama-8b-shape FP8 (fp8_bench) with the decode-size GEMM off, then on;
    # then the skinny kernel's GPU parity tests
    fp8_llama_skinny
    timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_skinny_gemm.py \
      2>&1 | tail -3
    ;;
  s30)  # issue 30: the decode-size GEMM's bench (quick sweep, with FP8 weights), then
    # llama-8b-shape decode (gpu_suite, sync and async) with it off (PDSERVE_SKINNY_ROWS=0),
    # up to 16 rows, up to 64 rows, up to 16 rows with PDL on, and off again
    timeout 200 python3 benchmarks/skinny_bench.py --quick --fp8 --out "$OUT/skinny.json" 2>&1 \
      | tee "$OUT/skinny.log" | quiet | tail -50
    llama_ckpt || exit 1
    for v in 0:0 16:0 64:0 16:1 0:0; do llama_decode ${v%%:*} ${v#*:} 570 70 || break; done
    ;;
  k35)  # issues 28 / 30: the skinny GEMM's GPU tests (FP8 wide steps, the transposed
    # MMA tile), FP8 llama-8b-shape (fp8_bench) with the decode-size GEMM off and at one
    # row, its quick sweep with FP8 weights, then FP8 to 64 rows, in the time left
    # (K35_END: the seconds the call has)
    end=${K35_END:-570}
    timeout 100 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_skinny_gemm.py \
      -k "fp8 or swapped or default" 2>&1 | tail -3
    for rows in ${K35_ROWS:-0 1}; do
      [ $(( start + end - $(date +%s) )) -gt 150 ] || { echo "fp8 rows $rows: no time"; exit 0; }
      FP8_SKINNY_ROWS=$rows fp8_llama_skinny
    done
    left=$(( start + end - $(date +%s) - 10 ))
    [ "$left" -gt 60 ] || { echo "skinny sweep: no time"; exit 0; }
    timeout "$left" python3 benchmarks/skinny_bench.py --quick --fp8 --out "$OUT/skinny.json" \
      2>&1 | tee "$OUT/skinny.log" | quiet | grep -E "^(fp8|qkv|o |gate|down)" | head -40
    [ $(( start + end - $(date +%s) )) -gt 150 ] && FP8_SKINNY_ROWS=64 fp8_llama_skinny
    ;;
  x36)  # issues 30 / 28 in one call: r11's llama pair (the tree against .baseline: an
    # experiment branch against main), then k35 in the time left (K35_END: the seconds
    # the call has; FP8 at one row before off)
    bash "$0" r11
    K35_ROWS="1 0" bash "$0" k35
    ;;
  s34)  # issues 30 / 28 in one call: torch SDPA's prefill kernels alone (flash, cuDNN with
    # its length buckets, K/V heads expanded or shared), r11's llama pair (the tree against
    # .baseline), then llama-8b-shape bf16 beside FP8 (fp8_bench: decode against each
    # roofline, 8K prefill against the fp8 rate, offline) in the time left (S34_END: the
    # seconds the call has)
    timeout 90 python3 benchmarks/kernels_bench.py --sections prefill --out "$OUT/sdpa_s34.json" \
      2>&1 | quiet | tail -8
    bash "$0" r11
    F35_END=${S34_END:-570} exec bash "$0" f35
    ;;
  b35)  # by card: c32 on an H200 (issues 30, 26, 27 need that card), else f35
    if on_h200; then
      exec bash "$0" c32
    fi
    exec bash "$0" f35
    ;;
  b37)  # by card: c32 on an H200 (issues 30, 26, 27 need that card), else f37
    if on_h200; then
      exec bash "$0" c32
    fi
    exec bash "$0" f37
    ;;
  b38)  # by card: h31 on an H200 (issue 30 whole, then 26), else f37
    if on_h200; then
      exec bash "$0" h31
    fi
    exec bash "$0" f37
    ;;
  h31)  # on an H200, every bar of issue 30 in one call: llama-8b-shape decode on the
    # defaults (async <= 1.15x at 1 / 16 / 64), glm5-m12-e64 decode at 1 x 1K / 16K with
    # the profile (x roofline, kernels a step); then glm5 16K prefill (issue 26) if 180 s
    # are left
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    llama_ckpt || exit 1
    llama_decode - - 570 60
    left=$(( start + 570 - $(date +%s) ))
    glm5_decode $(( left < 280 ? left : 280 )) h31
    left=$(( start + 570 - $(date +%s) ))
    [ "$left" -gt 180 ] || { echo "glm5 prefill: skipped, ${left}s left"; exit 0; }
    glm5_prefill $(( left - 5 )) 16k_b16384 16384 --budget 16384
    ;;
  v38)  # issue 27: the indexer's verify scores with the key block as the MMA's rows
    # (TileConfig "keys"): its GPU parity, the verify sweep beside the "rows" default, then
    # MTP decode at 192 / 208 x 16K with the sweep's best verify tile as the default
    timeout 100 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_dsa_indexer_tiled.py \
      tests/kernels/test_dsa_indexer.py -k "keys or fp8_key_scores" 2>&1 | tail -3
    timeout 150 python3 benchmarks/glm5_kernels_bench.py --sections indexer_verify \
      --out "$OUT/indexer_verify.json" > "$OUT/indexer_verify.log" 2>&1
    echo "indexer_verify: exit $?"
    # the sweep's table (on stderr, so it prints), and its best config (stdout)
    best=$(python3 - "$OUT/indexer_verify.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["indexer_verify"]
for r in rows:
    if r["kernel"].startswith(("tiled", "best", "old")):
        print(f"{r['case']:<28} {r['kernel']:<42} {r['ms'] or 0:8.3f} ms  "
              f"x_copy {r.get('x_copy') or 0:.2f}", file=sys.stderr)
b = next(r["config"] for r in rows if r["kernel"] == "best")
print(f'TileConfig("{b["variant"]}", bt={b["bt"]}, bn={b["bn"]}, span={b["span"]}, '
      f'num_warps={b["num_warps"]}, num_stages={b["num_stages"]})')
PY
)
    [ -n "$best" ] && sed -i "s/^VERIFY_TILE = .*/VERIFY_TILE = $best/" src/pdserve/kernels/dsa_indexer_tiled.py
    grep -n "^VERIFY_TILE" src/pdserve/kernels/dsa_indexer_tiled.py
    t=$(( start + ${V38_END:-430} - $(date +%s) ))
    [ "$t" -gt 60 ] || { echo "spec_bench: skipped, ${t}s left"; exit 0; }
    timeout "$t" python3 benchmarks/spec_bench.py --sections decode --streams 192,208 \
      --configs 0,3,3a --rates 0.7 --out "$OUT/spec_decode_v38.json" > "$OUT/spec_decode_v38.log" 2>&1
    echo "spec_bench decode: exit $?"; quiet < "$OUT/spec_decode_v38.log" | sed -n '/: decode at a/,$p'
    ;;
  f39)  # issue 28: glm5-m12-e64 decode at 32 x 16K, FP8 against bf16 (run 139: 10.84 against
    # 15.29 ms, 1.41x; bar 1.5x): where each step's time goes (profile by category)
    for v in bf16 fp8; do
      left=$(( start + 570 - $(date +%s) )); [ "$left" -gt 90 ] || break
      flag=; [ $v = fp8 ] && flag=--fp8
      timeout $(( left < 260 ? left : 260 )) python3 benchmarks/glm5_bench.py --sections profile \
        --presets glm5-m12-e64 --no-peer --workdir /tmp/glm5 --profile 32x16384 $flag \
        --out "$OUT/glm5_f39_$v.json" > "$OUT/glm5_f39_$v.log" 2>&1
      echo "glm5 profile 32 x 16K, $v: exit $?"; quiet < "$OUT/glm5_f39_$v.log" | tail -22
    done
    ;;
  p39)  # issue 26: glm5-m12-e64 16K prefill in one step, the MLA share against the burst
    # matmul rate and against the rate matmuls sustain at the card's power cap
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    glm5_prefill 200 16k_b16384 16384 --budget 16384
    ;;
  m39)  # issue 27's concurrency bar (>= 200 streams x 16K within TPOT 20 ms): run 138's
    # streams decoded 96 tokens, so the adaptive policy's first steps (graph timings,
    # exploring) weighed a third of its steady steps; 256 tokens a stream here, at 200 and
    # 208 streams, with k=1 beside no speculation and k=3 adaptive
    left=$(( start + ${M39_END:-570} - $(date +%s) ))
    timeout "$left" python3 benchmarks/spec_bench.py --sections decode --streams 200,208 \
      --configs 0,1,3a --rates 0.7 --out-tokens 256 --out "$OUT/spec_decode_m39.json" \
      > "$OUT/spec_decode_m39.log" 2>&1
    echo "spec_bench decode: exit $?"; quiet < "$OUT/spec_decode_m39.log" | sed -n '/: decode at a/,$p'
    # the verify step's select (3.84 ms of a 53.5 ms cycle at 192 streams, run 140) with
    # rows just past 16K keys held as two tiles instead of one 32K tile
    left=$(( start + ${M39_END:-570} - $(date +%s) ))
    [ "$left" -gt 150 ] || { echo "spec_bench tail16: skipped, ${left}s left"; exit 0; }
    PDSERVE_SELECT_TAIL=16 timeout "$left" python3 benchmarks/spec_bench.py --sections decode \
      --streams 208 --configs 3a --rates 0.7 --out-tokens 256 --out "$OUT/spec_decode_m39t.json" \
      > "$OUT/spec_decode_m39t.log" 2>&1
    echo "spec_bench decode, tail16: exit $?"; quiet < "$OUT/spec_decode_m39t.log" | sed -n '/: decode at a/,$p'
    ;;
  x39)  # issue 30: the top-k select split over several programs a row (run 137: one row
    # past 16K keys in the graphs' 32K buffer took 37 us a layer on one program): the
    # split select's and the two-tile rows' GPU parity, glm5 decode 1 x 1K / 16K with auto
    # taking the split select up to 8 rows, then with the two-tile rows
    # (PDSERVE_SELECT_TAIL; s38's rows0 run is the baseline), then select_bench's decode
    # cases (both beside the default, the split shapes) in the time left
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dsa_select_split.py \
      tests/kernels/test_dsa_indexer.py > "$OUT/x39_tests.log" 2>&1
    echo "split select tests: exit $?"; tail -3 "$OUT/x39_tests.log"
    for env in ${X39_ENVS:-PDSERVE_SELECT_SPLIT_ROWS=8 PDSERVE_SELECT_TAIL=16}; do
      left=$(( start + 575 - $(date +%s) )); [ "$left" -gt 120 ] || break
      tag=$(echo "$env" | sed 's/.*SELECT_//; s/=//' | tr A-Z a-z)  # split_rows8, tail16
      glm5_decode $(( left < 200 ? left : 200 )) "x39_$tag" "$env"
    done
    left=$(( start + 570 - $(date +%s) ))
    [ "$left" -gt 60 ] || { echo "select_bench: skipped, ${left}s left"; exit 0; }
    timeout "$left" python3 benchmarks/select_bench.py --cases decode --out "$OUT/select_x39.json" \
      > "$OUT/select_x39.log" 2>&1
    echo "select_bench decode: exit $?"; sed -n '/^== select/,$p' "$OUT/select_x39.log"
    grep -q '^== select' "$OUT/select_x39.log" || grep '"case"' "$OUT/select_x39.log" | cut -c1-150
    ;;
  s38)  # issue 30: glm5-m12-e64 decode at 1 x 1K / 16K (x roofline, kernels a step, idle in
    # the replay) with its linears on cuBLAS (the default) and on the decode-size GEMM
    # at one row (PDSERVE_SKINNY_ROWS=1), one call
    for rows in ${S38_ROWS:-0 1}; do
      left=$(( start + 575 - $(date +%s) )); [ "$left" -gt 120 ] || break
      glm5_decode $(( left < 280 ? left : 280 )) "s38_rows$rows" PDSERVE_SKINNY_ROWS=$rows
    done
    ;;
  f38)  # issue 28: decode attention over an fp8 cache at 16 x 16K took 8.53 ms a step
    # on the H200 against 8.30 for a bf16 cache of twice the bytes (run 139): its configs
    # at a 16K context, fp8 then bf16, batch 16 and 64
    for kv in fp8 auto; do
      timeout 150 python3 benchmarks/kernels_bench.py --sections decode_configs --kv-dtype $kv \
        --config-ctx 16384 --batches 16,64 --out "$OUT/decode_configs16k_$kv.json" \
        > "$OUT/decode_configs16k_$kv.log" 2>&1
      echo "decode_configs 16K, kv $kv: exit $?"; tail -4 "$OUT/decode_configs16k_$kv.log" | cut -c1-400
    done
    # issue 30: the indexer's select at one row past 16K keys in the graphs' 32K-wide
    # buffer (37 us a layer in run 137's glm5 1 x 16K step), on 16 and 32 warps
    left=$(( start + 570 - $(date +%s) ))
    [ "$left" -gt 60 ] || { echo "select_bench: skipped, ${left}s left"; exit 0; }
    timeout "$left" python3 benchmarks/select_bench.py --out "$OUT/select_f38.json" \
      > "$OUT/select_f38.log" 2>&1
    echo "select_bench: exit $?"; grep -E '"case": "decode' "$OUT/select_f38.log" | cut -c1-200
    ;;
  f37)  # issue 28 on the tree: llama-8b-shape bf16 beside FP8 (fp8_bench; the offline pass
    # timed after a warm pass under the profiler), then glm5-m12-e64 bf16 beside FP8 in the
    # time left (F37_END: the seconds the call has)
    left=$(( start + ${F37_END:-570} - $(date +%s) - 5 ))
    timeout "$left" python3 benchmarks/fp8_bench.py --models llama-8b-shape \
      --out "$OUT/fp8_bench_f37.json" > "$OUT/fp8_bench_f37.log" 2>&1
    echo "fp8_bench llama bf16,fp8: exit $?"; quiet < "$OUT/fp8_bench_f37.log" | sed -n '/^== /,$p'
    left=$(( start + ${F37_END:-570} - $(date +%s) - 5 ))
    [ "$left" -gt 200 ] || { echo "fp8_bench glm5: no time (${left}s)"; exit 0; }
    timeout "$left" python3 benchmarks/fp8_bench.py --models glm5-m12-e64 \
      --out "$OUT/fp8_glm5_f37.json" > "$OUT/fp8_glm5_f37.log" 2>&1
    echo "fp8_bench glm5 bf16,fp8: exit $?"; quiet < "$OUT/fp8_glm5_f37.log" | sed -n '/^== /,$p'
    ;;
  f35)  # issue 28: llama-8b-shape bf16 beside FP8 on the defaults (fp8_bench: decode
    # against each roofline, 8K prefill against the fp8 rate, offline; the prompt's
    # attention on cuDNN's SDPA kernel, the ws FP8 GEMM), then FP8 with the prompt's
    # attention on each of F35_SDPA (default: flash), in the time left (F35_END: the
    # seconds the call has)
    left=$(( start + ${F35_END:-570} - $(date +%s) - 5 ))
    [ "$left" -gt 120 ] || { echo "fp8_bench: no time (${left}s)"; exit 0; }
    timeout "$left" python3 benchmarks/fp8_bench.py --models llama-8b-shape \
      --out "$OUT/fp8_bench_f35.json" > "$OUT/fp8_bench_f35.log" 2>&1
    echo "fp8_bench llama bf16,fp8: exit $?"; quiet < "$OUT/fp8_bench_f35.log" | sed -n '/^== /,$p'
    for kern in ${F35_SDPA:-flash}; do
      left=$(( start + ${F35_END:-570} - $(date +%s) - 5 ))
      [ "$left" -gt 70 ] || { echo "fp8 sdpa $kern: no time (${left}s)"; exit 0; }
      PDSERVE_SDPA_PREFILL=$kern timeout "$left" python3 benchmarks/fp8_bench.py \
        --models llama-8b-shape --variants fp8 --out "$OUT/fp8_sdpa_$kern.json" \
        > "$OUT/fp8_sdpa_$kern.log" 2>&1
      echo "fp8 llama, SDPA $kern: exit $?"; quiet < "$OUT/fp8_sdpa_$kern.log" | grep -E "^ *(prefill|  fp8 prefill)"
    done
    ;;
  b33)  # by card: c32 on an H200 (issues 30, 26, 27 need that card), else fp8w
    if on_h200; then
      exec bash "$0" c32
    fi
    exec bash "$0" fp8w
    ;;
  b32)  # by card: c32 on an H200, else k34
    if on_h200; then
      exec bash "$0" c32
    fi
    exec bash "$0" k34
    ;;
  k34)  # issue 30: the skinny GEMM's GPU tests, its layer section (the register path's
    # per-element partials; the norms folded in one pass at one row), then r11's llama
    # pair against .baseline (scripts/make-baseline 4189cb7: before the partials)
    timeout 100 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_skinny_gemm.py \
      -k "split or llama_shapes or early or prologue" 2>&1 | tail -3
    timeout 120 python3 benchmarks/skinny_bench.py --rows 1,16 --projs "" \
      --out "$OUT/skinny_layer.json" 2>&1 | tee "$OUT/skinny_layer.log" | quiet | tail -20
    exec bash "$0" r11
    ;;
  c32)  # by card. On an H200 (issues 30, 26, 27): llama-8b-shape decode on the defaults
    # and with the decode-size GEMM and PDL off (issue 30's llama bar is the H200's), glm5
    # 16K prefill (the MLA share), decode streams within 20 ms at 192 x 16K in the time
    # left. Elsewhere: the decode attention configs at 1K, batch 1 / 16 / 64 (issue 30)
    if on_h200; then
      llama_ckpt || exit 1
      for v in -:- 0:0; do llama_decode ${v%%:*} ${v#*:} 570 60 || break; done
      glm5_prefill 170 16k_b16384 16384 --budget 16384
      t=$(( start + 570 - $(date +%s) ))
      [ "$t" -gt 150 ] || { echo "spec_bench: skipped, ${t}s left"; exit 0; }
      timeout "$t" python3 benchmarks/spec_bench.py --sections decode --streams 192 \
        --configs 0,3a --rates 0.7 --out "$OUT/spec_decode_c32.json" > "$OUT/spec_decode_c32.log" 2>&1
      echo "spec_bench decode: exit $?"; quiet < "$OUT/spec_decode_c32.log" | sed -n '/: decode at a/,$p'
    else
      t=$(( start + 560 - $(date +%s) ))
      timeout "$t" python3 benchmarks/kernels_bench.py --sections decode_configs \
        --out "$OUT/decode_configs.json" 2>&1 | tee "$OUT/decode_configs.log" | quiet | tail -8
    fi
    ;;
  k33)  # issue 30 / 28: llama-8b-shape decode on the defaults (decode-size GEMM and PDL
    # to 16 rows), then FP8 (fp8_bench) with it off and on
    llama_ckpt || exit 1
    llama_decode - - 570 60
    fp8_llama_skinny
    ;;
  k32)  # issue 30: the skinny GEMM's GPU tests (early weight steps, split-K, PDL in a
    # graph), the layer section alone (PDL off / on, early_w 0-2), then llama-8b-shape
    # decode off, to 16 rows, to 16 rows with PDL, to 1 row with PDL, off again
    timeout 100 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_skinny_gemm.py \
      tests/kernels/test_pdl.py -k "split or llama_shapes or early or graph" 2>&1 | tail -3
    timeout 120 python3 benchmarks/skinny_bench.py --rows 1,16 --projs "" \
      --out "$OUT/skinny_layer.json" 2>&1 | tee "$OUT/skinny_layer.log" | quiet | tail -20
    llama_ckpt || exit 1
    for v in 0:0 16:0 16:1 1:1 0:0; do llama_decode ${v%%:*} ${v#*:} 570 60 || break; done
    ;;
  k31)  # issue 30: the skinny GEMM's GPU tests (split-K's counters under real concurrency),
    # then skinny_bench's quick sweep without the FP8 section in the time left
    [ "${K31_TESTS:-1}" = 0 ] || timeout 100 python3 -m pytest -p no:cacheprovider -q \
      tests/kernels/test_skinny_gemm.py -k "split or llama_shapes" 2>&1 | tail -3
    t=$(( start + 570 - $(date +%s) ))
    timeout "$t" python3 benchmarks/skinny_bench.py --quick --rows "${K31_ROWS:-1,16}" \
      --projs "${K31_PROJS-qkv,o,gate_up,down}" \
      --out "$OUT/skinny.json" 2>&1 | tee "$OUT/skinny.log" | quiet | tail -50
    ;;
  c31)  # by card: on an H200 first issue 26's glm5 16K prefill (MLA share), then k31's tests
    # and sweep in the time left; elsewhere k31
    if on_h200; then
      nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
      glm5_prefill 170 16k_b16384 16384 --budget 16384
    fi
    exec bash "$0" k31
    ;;
  b31)  # by card: h30 on an H200, else k31
    if on_h200; then
      exec bash "$0" h30
    fi
    exec bash "$0" k31
    ;;
  a31)  # session 31's first call, by card: on an H200 the h30 runs (issues 26, 27); on
    # any other card issue 29's 1P1D nixl serve run, then the skinny sweep in the time left
    if on_h200; then
      exec bash "$0" h30
    fi
    python3 -c "from pdserve.kv_transfer.transports.nixl import load_nixl; print(load_nixl())" \
      || exit 1
    nixl_serve 330 | tail -40
    t=$(( start + 570 - $(date +%s) ))
    [ "$t" -gt 60 ] || { echo "skinny: skipped, ${t}s left"; exit 0; }
    timeout "$t" python3 benchmarks/skinny_bench.py --quick --fp8 --out "$OUT/skinny.json" 2>&1 \
      | tee "$OUT/skinny.log" | quiet | tail -50
    ;;
  h30)  # on an H200 (issues 26, 27): glm5-m12-e64 prefill 16K in one step and in the serve
    # default's 8K steps (the MLA share), then decode-only streams within 20 ms: no
    # speculation and adaptive MTP k=3 at 192 / 208 / 224 streams x 16K
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
    glm5_prefill 170 16k_b16384 16384 --budget 16384
    t=$(( start + 570 - $(date +%s) ))
    timeout "$t" python3 benchmarks/spec_bench.py --sections decode --streams 192,208,224 \
      --configs 0,3a --rates 0.7 --out "$OUT/spec_decode_h30.json" > "$OUT/spec_decode_h30.log" 2>&1
    echo "spec_bench decode: exit $?"; quiet < "$OUT/spec_decode_h30.log" | sed -n '/: decode at a/,$p'
    ;;
  xfer)  # the early copy's order and the block-copy shapes (issue 29)
    timeout 60 python3 -m pytest -p no:cacheprovider -q -m gpu tests/kv_transfer/test_block_copy.py \
      2>&1 | tail -3
    timeout 90 python3 benchmarks/transfer_bench.py --transports cuda_ipc --no-equality \
      --variants before,send,flush,after --copy-shapes 8192:4,16384:4,16384:8,32768:8 \
      --out "$OUT/transfer_variants.json" 2>&1 | tee "$OUT/transfer_variants.log" | quiet | tail -40
    ;;
  f11)
    timeout 150 python3 -m pytest -p no:cacheprovider -q tests/kernels/test_fp8_activation.py \
      tests/kernels/test_fp8.py tests/kernels/test_fused_moe_fp8.py tests/kernels/test_rmsnorm.py \
      tests/kernels/test_activation.py tests/kernels/test_dsa_indexer.py \
      tests/kernels/test_mla_prep.py tests/kv_transfer/test_block_copy.py 2>&1 | tail -8
    timeout 200 python3 benchmarks/fp8_bench.py --models llama-8b-shape \
      --out "$OUT/fp8_llama.json" 2>&1 | tee "$OUT/fp8_llama.log" | quiet
    timeout 120 python3 benchmarks/glm5_kernels_bench.py --sections indexer_fp8 \
      --out "$OUT/glm5_indexer_fp8.json" 2>&1 | tee "$OUT/indexer_fp8.log" | quiet | tail -30
    left=$(( start + 575 - $(date +%s) ))
    timeout "$left" python3 benchmarks/transfer_bench.py --transports cuda_ipc --no-equality \
      --out "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.log" | quiet
    ;;
  f11g)
    timeout 570 python3 benchmarks/fp8_bench.py --models glm5-m12-e64 \
      --out "$OUT/fp8_glm5.json" 2>&1 | tee "$OUT/fp8_glm5.log" | quiet
    ;;
  r11|r11g|r11all)  # r11all: one round of each, the llama pair A B, the glm5 pair B A
    [ -d .baseline/src/pdserve ] || { echo "no .baseline/src (scripts/make-baseline)"; exit 1; }
    # rounds alternate the order (A B, then B A), so a drift over the call (clocks, the
    # host) weighs on both trees alike
    order() { if [ $(( $1 % 2 )) = 1 ]; then echo "$2 $3"; else echo "$3 $2"; fi; }
    # R11_ROUNDS (default 2): more rounds where one process's sync steps spread more than
    # the bar between starts (run 89: 6-9% between the two runs of one tree)
    rounds=$(seq 1 "${R11_ROUNDS:-2}"); first=1
    [ $stage = r11all ] && rounds=1
    if [ $stage != r11g ]; then
      llama_ckpt || exit 1
      for round in $rounds; do
        for tree in $(order $round baseline current); do r11_run llama $tree $round; done
      done
    fi
    [ $stage = r11all ] && first=2  # the glm5 pair in the other order
    if [ $stage != r11 ]; then
      for round in $rounds; do
        for tree in $(order $(( round + first - 1 )) baseline current); do
          r11_run glm5 $tree $round
        done
      done
    fi
    python3 benchmarks/pair_compare.py --dir "$OUT" --out "$OUT/r11_compare.json"
    ;;
  pdl2)  # issues 28/30: does PDL pay on llama-8b-shape decode? bf16 (gpu_suite, sync and
        # async) PDL on, off, off, on; then FP8 (fp8_bench) on, off (run 77 ran off, on)
    llama_ckpt || exit 1
    i=0
    for pdl in 1 0 0 1; do
      i=$(( i + 1 ))
      PDSERVE_PDL=$pdl timeout 100 python3 benchmarks/gpu_suite.py --ckpt $ck --sections decode \
        --batches 1,16,64 --contexts 1024 --out "$OUT/pdl2_bf16_${i}_pdl$pdl.json" \
        > "$OUT/pdl2_bf16_${i}_pdl$pdl.log" 2>&1
      echo "bf16 decode PDSERVE_PDL=$pdl: exit $?"; sed -n '/^ batch /,/^batch /p' "$OUT/pdl2_bf16_${i}_pdl$pdl.log"
    done
    for pdl in 1 0; do
      left=$(( start + 570 - $(date +%s) )); [ "$left" -gt 60 ] || break
      PDSERVE_PDL=$pdl timeout $(( left < 120 ? left : 120 )) python3 benchmarks/fp8_bench.py \
        --models llama-8b-shape --variants fp8 --out "$OUT/pdl2_fp8_pdl$pdl.json" \
        > "$OUT/pdl2_fp8_pdl$pdl.log" 2>&1
      echo "fp8 PDSERVE_PDL=$pdl: exit $?"; grep '^decode' "$OUT/pdl2_fp8_pdl$pdl.log"
    done
    ;;
  h31)  # issue 31: the host's phases of a synchronous llama-8b-shape decode step, both
        # trees, A B B A (benchmarks/host_phases.py; each tree on its own src), at
        # gpu_suite's sizes (run 82: its synchronous steps lost more than run 81's), with
        # the hot functions compared. H31_TINY=1: the tiny Llama instead (quick; the step is
        # then mostly host time)
    [ -d .baseline/src/pdserve ] || { echo "no .baseline/src (scripts/make-baseline)"; exit 1; }
    sizes="--max-model-len 20480 --max-num-seqs 256 --top ${H31_TOP:-40}"
    if [ -n "${H31_TINY:-}" ]; then
      ck=/tmp/tiny-llama sizes="--top ${H31_TOP:-40}"
      [ -f $ck/config.json ] || pdserve make-checkpoint --arch LlamaForCausalLM --preset tiny \
        --out $ck >/dev/null
    else
      llama_ckpt || exit 1
    fi
    i=0
    for tree in ${H31_TREES:-baseline current current baseline}; do
      i=$(( i + 1 ))
      left=$(( start + 570 - $(date +%s) )); [ "$left" -gt 40 ] || break
      root=.; [ $tree = baseline ] && root=.baseline
      PYTHONPATH="/tmp/site:$PWD/$root/src" timeout $(( left < 150 ? left : 150 )) python3 \
        benchmarks/host_phases.py --ckpt $ck --label $tree $sizes \
        --out "$OUT/h31_${i}_$tree.json" 2>&1 | grep -v Warning | sed -n '/^host us/,$p'
    done
    python3 benchmarks/host_phases.py --compare "$OUT"/h31_*.json --out "$OUT/h31_hot.json"
    ;;
  gpu1)  # tests/kernels, a process per module
    manifest="$OUT/tests/gpu1.tsv"; mkdir -p "$OUT/tests"; : > "$manifest"
    module_tests $(( start + ${TESTS_BUDGET:-530} )) "$manifest" tests/kernels/test_*.py
    test_table "$manifest" "$OUT/gpu1_tests.json"
    ;;
  gpu2)  # the gpu-marked tests elsewhere, then gpu_suite.py (all sections)
    manifest="$OUT/tests/gpu2.tsv"; mkdir -p "$OUT/tests"; : > "$manifest"
    notes="$OUT/tests/gpu2_not_run.tsv"; : > "$notes"
    mapfile -t marked < <(gpu_marked_modules "$notes")
    module_tests $(( start + ${TESTS_BUDGET:-240} )) "$manifest" ${marked[@]+"${marked[@]}"}
    cat "$notes" >> "$manifest"
    test_table "$manifest" "$OUT/gpu2_tests.json"
    llama_ckpt || exit 1
    left=$(( start + 575 - $(date +%s) ))
    echo "gpu_suite: all sections, ${left}s left"
    timeout "$left" python3 benchmarks/gpu_suite.py --ckpt $ck --out "$OUT/gpu_suite.json" \
      > "$OUT/gpu_suite.log" 2>&1
    echo "gpu_suite exit $?"
    if grep -q '^== ' "$OUT/gpu_suite.log"; then
      sed -n '/^== /,$p' "$OUT/gpu_suite.log"
    else  # killed before its table: what it printed last (the JSON holds every finished section)
      quiet < "$OUT/gpu_suite.log" | tail -20
    fi
    ;;
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
    spec=()
    tag=none
    if [ "${2:-}" = mtp ]; then
      spec=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0.7}')
      tag=mtp3-0.7
    fi
    pdserve serve $g --host 127.0.0.1 --port 8000 --load-format dummy \
      --max-model-len 17500 "${spec[@]}" > "$OUT/glm5_server.log" 2>&1 &
    server=$!
    timeout 540 python3 -m pdserve.cli bench sla --base-url http://127.0.0.1:8000 --model $g \
      --random-input-len 16384 --random-output-len 1000 --num-prompts 48 --num-warmups 1 \
      --start 1.0 --tolerance 0.2 --sla-ttft-ms 2500 --sla-tpot-ms 20 --num-gpus 1 \
      --ready-check-timeout-sec 300 --disable-tqdm --result-dir "$OUT" \
      --result-filename "glm5-sla-16384-1000-$tag.json" 2>&1 | quiet
    curl -s http://127.0.0.1:8000/metrics | grep -E "^pdserve:(forward_steps_total|num_requests_running)"
    kill $server; wait $server 2>/dev/null
    ;;
  nixl)  # NIXL from the slim wheel in .whl-nixl (scripts/fetch-wheels --nixl), then the runs
    python3 -c "from pdserve.kv_transfer.transports.nixl import load_nixl; print(load_nixl())" \
      || exit 1
    # nixl: the default thread pool (a READ split over 4 UCX workers, each its own CUDA
    # streams); nixl:0: one worker, whose GETs from one GPU run one after another (run 111)
    UCX_PROTO_INFO=y timeout 200 python3 benchmarks/transfer_bench.py \
      --transports cuda_ipc,nixl:0,nixl --out "$OUT/transfer_nixl.json" > "$OUT/transfer_nixl.log" 2>&1
    echo "transfer_bench: exit $?"; grep -vE "^\[[0-9.]+\] " "$OUT/transfer_nixl.log" | quiet
    echo "UCX's protocol for a READ (run 103: software emulation over tcp/lo):"
    grep -A6 "remote memory read by ucp_get" "$OUT/transfer_nixl.log" | grep -E "read by|\| [0-9]" \
      | sed -E 's/^\[[^]]*\] \[[^]]*\] +//' | sort -u | head -8
    nixl_serve 330
    ;;
  x2)
    timeout 120 python3 -m pytest -p no:cacheprovider -q -m gpu \
      tests/kv_transfer/test_transports.py 2>&1 | tail -5
    # nixl across the two GPUs (carry .whl-nixl too): UCX's GET is a cuMemcpyDtoDAsync a
    # descriptor on one stream, which on one GPU moved 0.9-1.1 TB/s at 64K against the
    # copy kernel's 1.5 (runs 107, 110: 2.3x the bound at 16K); across GPUs the bound is
    # the peer copy, a driver memcpy as well
    nx=cuda_ipc,tcp; python3 -c "import pdserve.kv_transfer.transports.nixl as n; n.load_nixl()" \
      2>/dev/null && nx=cuda_ipc,nixl,tcp
    timeout 150 python3 benchmarks/transfer_bench.py --device cuda:0 --prefill-device cuda:1 \
      --transports $nx --no-equality --out "$OUT/transfer_x2.json" 2>&1 | quiet
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
