"""FP8 on the GPU (issues 19, 28): llama-8b-shape and glm5-m12-e64 in bf16 and in
block-scaled FP8, side by side.

    python3 benchmarks/fp8_bench.py --out $OUT/fp8_bench.json                 # both models
    python3 benchmarks/fp8_bench.py --out $OUT/fp8_glm5.json --models glm5-m12-e64

Makes no weights file: each model's config and tokenizer are written to ``--workdir``
(``make-checkpoint --config-only``) and both engines draw the same random values on the
GPU (``--load-format dummy``); the FP8 engine quantizes them as it loads
(``--quantization fp8``: the values ``make-checkpoint --quantization fp8`` writes; the
norms and SiLU-and-mul whose consumers are all FP8 linears then emit fp8 activations,
``fuse_fp8_activations``) and keeps its KV cache in fp8 (``--kv-cache-dtype fp8``).

Measured in one call, on the card it runs on:
  limits   copy bandwidth and bf16 matmul rate (gpu_suite.measure_limits), and the FP8
           matmul peak: torch._scaled_mm, 8192^3, per-tensor scales
  gemm     one llama-8b-shape linear (down_proj, 4096 x 14336) at 1/16/64/8192 tokens:
           the Triton block-FP8 kernel quantizing x itself and reading a pre-quantized x
           (what a fused producer hands it), torch._scaled_mm with 128x128 block scales
           (where this PyTorch supports it) and bf16, against the byte roofline; up to
           256 rows replayed from CUDA graphs, as a decode step runs them (``timing``)
  per model (``--models``), each variant (``--variants``, bf16 and fp8):
  decode   decode step against the byte roofline, and which path ran (graph / eager):
           llama-8b-shape at batch 1/16/64 x 1K and 16 x 16K (weights + KV bytes over
           the measured copy bandwidth: gpu_suite.bench_decode); glm5-m12-e64 at 1 and
           32 x 1K and 16K (the DecodeByteModel of glm5_bench: dense weights, the experts
           the step's routing took, the latent rows DSA reads, the indexer keys); each
           engine's bytes are its own (FP8 weights and KV for the fp8 variant);
           Llama's points also carry the top kernels of 5 profiled steps (``kernels``)
           and the step with one step in flight, the engine's default (``async_ratio``,
           printed ``a1.23`` after the synchronous ``x`` ratio)
  prefill  one 8K and one 16K prompt: tok/s, and its matmul FLOPs over the bf16 and the
           FP8 peak (the compute roofline: ``roofline_s`` at the variant's own peak),
           timed around ``generate`` (16K is two chunks of the 8K token budget); Llama
           also ``prefill_step``: one 8K engine step alone (gpu_suite.bench_prefill, the
           number earlier runs and issue 28's acceptance use); ``prefill_profile``: one
           8K prompt under the profiler, device time by category and the longest kernels
  offline  prompts x 512 in / 128 out: output tok/s (the serve-shaped number), timed
           after one pass of the same prompts under the profiler (device time by
           category, idle gap: the device waiting on the host, the longest kernels; the
           Triton variants that pass compiled), and the engine steps by path
Prints one table per model (bf16 | fp8 per row) and writes every number to ``--out``.
About 3 minutes per model on an H200.

``--device cpu`` runs every part on the tiny Llama and the tiny GLM-5 at gpu_suite's CPU
sizes, the Triton GEMM in the interpreter (``TRITON_INTERPRET=1`` is set before the
kernels are imported; tests/bench/test_bench_scripts.py runs it): a smoke run, its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graph import capture_calls  # noqa: E402
from gpu_suite import (  # noqa: E402
    CPU_SIZES,
    GPU_SIZES,
    Sizes,
    _timed,
    bench_decode,
    bench_prefill,
    bench_throughput,
    kv_bytes_per_token,
    measure_limits,
    offline_workload,
    weight_bytes,
)

from pdserve import LLM  # noqa: E402
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

# (GEMM (n, k), GEMM token counts) on the GPU and in the CPU smoke run
GPU_GEMM = ((4096, 14336), (1, 16, 64, 8192))
CPU_GEMM = ((256, 384), (1, 16))
# model -> (architecture, preset on the GPU, decode points on the GPU, on the CPU)
MODELS: dict[str, tuple[str, str, tuple, tuple]] = {
    "llama-8b-shape": (
        "LlamaForCausalLM",
        "llama-8b-shape",
        ((1, 1024), (16, 1024), (64, 1024), (16, 16384)),
        ((1, 24), (2, 24)),
    ),
    "glm5-m12-e64": (
        "GlmMoeDsaForCausalLM",
        "glm5-m12-e64",
        ((1, 1024), (32, 1024), (1, 16384), (32, 16384)),
        ((1, 8), (2, 24)),
    ),
}
PREFILL_LENS = (8192, 16384)
CPU_PREFILL_LENS = (16, 40)
GRAPH_MAX_TOKENS = 256  # GEMMs of up to this many rows are timed as graph replays
VARIANTS = {
    "bf16": {},
    "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def _time_ms(fn: Callable[[], object], dev: torch.device, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(_timed(fn, dev) for _ in range(reps)) * 1e3


def _graph_time_ms(fn: Callable[[], object], dev: torch.device) -> float:
    """One call's ms replayed from a CUDA graph of 10 calls, as a decode step runs it
    (eager launches of a small GEMM time the host, not the kernel); eager on the CPU."""
    if dev.type != "cuda":
        return _time_ms(fn, dev)
    return _time_ms(capture_calls([fn] * 10).replay, dev) / 10


def fp8_matmul_peak(dev: torch.device, m: int = 8192) -> float:
    """FLOP/s of torch._scaled_mm on fp8 e4m3 operands with per-tensor scales."""
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=dev)
    ms = _time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), dev, 10)
    return 2 * m**3 / (ms / 1e3)


def bench_gemm(
    limits: dict, dev: torch.device, shape: tuple[int, int], tokens: tuple[int, ...]
) -> list[dict]:
    """down_proj's FP8 GEMM (``shape`` = (n, k)) at each token count: Triton (x bf16, and
    x pre-quantized), scaled_mm and bf16 against the byte roofline. Up to
    ``GRAPH_MAX_TOKENS`` rows every GEMM is replayed from a CUDA graph (``timing``)."""
    from pdserve.kernels.fp8_gemm import block_fp8_gemm, scaled_mm_block_fp8
    from pdserve.kernels.reference import quantize_fp8_activation, quantize_fp8_blocks

    n, k = shape
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    wq, ws = quantize_fp8_blocks(w, (128, 128))
    bw = limits["copy_bandwidth_Bps"]
    out = []
    for m in tokens:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        graph = m <= GRAPH_MAX_TOKENS
        timer = _graph_time_ms if graph else _time_ms
        row: dict = {"tokens": m, "n": n, "k": k, "timing": "graph" if graph else "eager"}
        row["bf16_ms"] = timer(lambda x=x: x @ w.t(), dev)
        row["triton_fp8_ms"] = timer(lambda x=x: block_fp8_gemm(x, wq, ws), dev)
        xa = quantize_fp8_activation(x)  # as a fused producer hands it over
        row["triton_fp8_prequant_ms"] = timer(lambda xa=xa: block_fp8_gemm(xa, wq, ws), dev)
        try:
            row["scaled_mm_fp8_ms"] = timer(
                lambda x=x: scaled_mm_block_fp8(x, wq, ws, torch.bfloat16), dev
            )
        except Exception as e:  # the blockwise recipe needs a recent PyTorch on Hopper
            row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["fp8_roofline_ms"] = (n * k + 2 * m * k + 2 * m * n) / bw * 1e3
        row["bf16_roofline_ms"] = (2 * n * k + 2 * m * k + 2 * m * n) / bw * 1e3
        row["tflops_triton"] = 2 * m * n * k / row["triton_fp8_ms"] / 1e9
        out.append(row)
    return out  # the weights go with this frame; bench_variant empties the cache


def _engine(ckpt: Path, name: str, args: argparse.Namespace, sizes: Sizes, glm: bool) -> LLM:
    kw: dict = dict(dtype=sizes.dtype, load_format="dummy", max_model_len=sizes.max_model_len,
                    max_num_batched_tokens=sizes.max_num_batched_tokens)  # fmt: skip
    if args.device == "cpu":
        kw.update(device="cpu", max_num_seqs=sizes.max_num_seqs)
    elif glm:  # 32 x 16K decode: the batch and its contexts (as glm5_bench sizes it)
        kw.update(max_model_len=16384 + 256, max_num_seqs=32, gpu_memory_utilization=0.9,
                  compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})  # fmt: skip
    else:
        kw.update(max_num_seqs=64, kv_cache_memory_bytes=args.kv_cache_gb * 2**30,
                  compilation_config={"cudagraph_capture_sizes": [1, 16, 64]})  # fmt: skip
    return LLM(str(ckpt), **kw, **VARIANTS[name])


def _sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def _path(graph_steps: int, steps: int) -> str:
    return "graph" if graph_steps >= steps else "eager" if graph_steps == 0 else "mixed"


def _decode_dense(llm: LLM, batch: int, ctx: int, limits: dict) -> dict:
    """Synchronous steps (the replay and the top kernels are read from them), then the
    same point with one step in flight, the engine's default scheduling (``async_*``: as
    gpu_suite reports it; the glm5 points time the default)."""
    r = bench_decode(llm, batch, ctx, limits, steps=12, profile=True)
    if "skipped" not in r:
        r["path"] = "eager" if r.get("graph_replay_ms") is None else "graph"
        ra = bench_decode(llm, batch, ctx, limits, steps=12, async_scheduling=True)
        r["async_step_ms"], r["async_ratio"] = ra.get("step_ms"), ra.get("ratio")
    return r


def _decode_glm(llm: LLM, batch: int, ctx: int, limits: dict) -> dict:
    """glm5_bench's decode point: the roofline from the bytes the step's routing took."""
    import glm5_bench

    steps = 12 if llm.engine.runner.device.type == "cuda" else 3
    bm = glm5_bench._byte_model(llm)
    r = glm5_bench._decode(llm, bm, batch, ctx, limits["copy_bandwidth_Bps"], steps)
    r["path"] = _path(r["graph_steps"], steps)
    r["tok_s"] = batch / (r["step_ms"] / 1e3)
    return r


def _prefill_flops(llm: LLM, n: int, glm: bool) -> float:
    """Matmul FLOPs of one ``n``-token prompt: PrefillFlopModel (GLM-5), or every
    parameter twice per token plus causal attention (Llama, as gpu_suite counts it)."""
    model, hc = llm.engine.runner.model, llm.engine.runner.hf_config
    if glm:
        from pdserve.profiling.prefill_flops import PrefillFlopModel

        return PrefillFlopModel.from_model(model).flops(n)["total"]
    params = sum(p.numel() for p in model.parameters()) - hc.vocab_size * hc.hidden_size
    return 2 * params * n + 2 * hc.num_hidden_layers * hc.num_attention_heads * hc.head_dim * n * n


def bench_prefill_lens(
    llm: LLM, limits: dict, lens: tuple[int, ...], name: str, glm: bool
) -> list[dict]:
    """One prompt of each length (max_tokens 1, chunked at the token budget): the median
    of two timed runs after one untimed, against the variant's own matmul peak."""
    from pdserve import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = min(150000, eng.vocab_size)
    g = torch.Generator().manual_seed(11)
    peak = limits["fp8_matmul_flops" if name == "fp8" else "bf16_matmul_flops"]
    out = []
    for n in lens:
        if n + 1 > eng.max_model_len:
            out.append({"tokens": n, "skipped": f"max_model_len {eng.max_model_len}"})
            continue
        times = []
        for _ in range(3):
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            _sync(llm)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp)
            _sync(llm)
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times[1:])
        flops = _prefill_flops(llm, n, glm)
        out.append({
            "tokens": n, "seconds": sec, "tok_s": n / sec, "tflops": flops / sec / 1e12,
            "share_of_matmul_peak": flops / sec / limits["bf16_matmul_flops"],
            "share_of_fp8_peak": flops / sec / limits["fp8_matmul_flops"],
            "roofline_s": flops / peak, "ratio": sec / (flops / peak),
        })  # fmt: skip
    return out


def _prefill_profile(llm: LLM, n: int) -> dict:
    """One ``n``-token prompt's prefill under the profiler: device time by category
    (pdserve.profiling.step_profile), kernels, idle gap and the longest kernels."""
    from pdserve import SamplingParams

    eng = llm.engine
    if n + 1 > eng.max_model_len:
        return {"skipped": f"max_model_len {eng.max_model_len}"}
    ids = torch.randint(3, min(150000, eng.vocab_size), (n,),
                        generator=torch.Generator().manual_seed(13)).tolist()  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run = partial(llm.generate, [{"prompt_token_ids": ids}], sp)
    return {"tokens": n, **_profile_table(llm, run)}


def _profile_table(llm: LLM, run: Callable[[], object]) -> dict:
    """``run`` under the profiler: device span, kernels, idle gap, time by category and
    the longest kernels (pdserve.profiling.step_profile)."""
    from pdserve.profiling.step_profile import profile_step

    eng = llm.engine
    t = profile_step(run, eng.runner.model, eng.runner.device).table()
    return {"span_ms": t["span_ms"], "kernels": t["kernels"],
            "idle_gap_ms": t["idle_gap"]["ms"],
            "categories": {c: round(v["ms"], 3) for c, v in t["categories"].items() if v["ms"]},
            "top": [{k: x[k] for k in ("name", "ms", "count")} for x in t["top"][:8]]}  # fmt: skip


def _offline(llm: LLM, num: int, inp: int, out: int) -> dict:
    """gpu_suite's offline throughput after one pass of the same workload under the
    profiler (``profile``: where the device time went; its idle gap is the time the
    device waited on the host). That first pass also compiles what the engine's warm-up
    left to the traffic (``first_pass_compiles``: Triton variants by kernel; with a cold
    cache the first variant's offline run in run 135 took 4.69 s where the same workload
    took 3.81 s warm), so the timed pass measures the engine, not the compiler: its
    ``kernel_compiles`` must be empty. Also the engine steps the timed pass took, by path
    (graph replays of pure decode batches, eager mixed and prefill steps)."""
    from pdserve.profiling.kernel_compiles import compiled_variants, new_variants

    prompts, sp = offline_workload(llm, num, inp, out, seed=1)
    compiled0 = compiled_variants()
    profile = _profile_table(llm, partial(llm.generate, prompts, sp))
    compiled1 = compiled_variants()
    before = llm.engine.stats()
    res = bench_throughput(llm, num=num, inp=inp, out=out)
    after = llm.engine.stats()
    res["kernel_compiles"] = new_variants(compiled1, compiled_variants())
    first = new_variants(compiled0, compiled1)
    res["first_pass_compiles"] = {k: len(v) for k, v in first.items()}
    # each one's cache key (its specialisation) beside the keys the warm-up compiled: what
    # the warm-up missed (an int argument's divisibility, a constexpr's value)
    res["first_pass_variants"] = {
        k: {"new": v, "warm_up": sorted(map(str, compiled0.get(k, set())))} for k, v in first.items()
    }
    res["steps"] = after.num_steps - before.num_steps
    paths = {k: v - before.step_paths.get(k, 0) for k, v in after.step_paths.items()}
    res["step_paths"] = {k: n for k, n in paths.items() if n}
    res["profile"] = profile
    return res


def bench_variant(
    ckpt: Path, name: str, limits: dict, args: argparse.Namespace, sizes: Sizes,
    points: tuple, glm: bool,
) -> dict:  # fmt: skip
    t0 = time.perf_counter()
    llm = _engine(ckpt, name, args, sizes, glm)
    res: dict = {
        "startup_s": time.perf_counter() - t0,
        "weight_bytes": weight_bytes(llm),
        "kv_bytes_per_token": kv_bytes_per_token(llm),
        "cudagraph_mode": llm.engine.runner.graph_mode(),
        "fp8_activation_producers": _fp8_producers(llm),
    }
    res["decode"] = []
    for batch, ctx in points:
        r = (_decode_glm if glm else _decode_dense)(llm, batch, ctx, limits)
        print(name, json.dumps({k: v for k, v in r.items() if k != "bytes"}), flush=True)
        res["decode"].append(r)
    lens = CPU_PREFILL_LENS if args.device == "cpu" else PREFILL_LENS
    res["prefill"] = bench_prefill_lens(llm, limits, lens, name, glm)
    print(name, json.dumps(res["prefill"]), flush=True)
    res["prefill_profile"] = _prefill_profile(llm, lens[0])
    if not glm:  # the number issue 28's acceptance and earlier runs read: one 8K step
        step = bench_prefill(llm, limits, sizes.prefill_len)
        if "tflops" in step:
            step["share_of_fp8_peak"] = step["tflops"] * 1e12 / limits["fp8_matmul_flops"]
        res["prefill_step"] = step
        print(name, json.dumps(step), flush=True)
    num, inp, out = sizes.throughput
    res["offline"] = _offline(llm, num // 2, inp, out)
    print(name, json.dumps(res["offline"]), flush=True)
    llm.engine.shutdown()
    del llm
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return res


def _fp8_producers(llm: LLM) -> int:
    """How many norms / SiLU-and-mul layers emit fp8 activations (0 for bf16)."""
    return sum(bool(getattr(m, "quant_out", False)) for m in llm.engine.runner.model.modules())


def _cell(r: dict) -> str:
    if "skipped" in r:
        return "skipped"
    roof = r.get("roofline_ms")
    ratio = f" x{r['ratio']:.2f}" if roof else ""
    if r.get("async_ratio"):  # sync step, then the async one's ratio
        ratio += f" a{r['async_ratio']:.2f}"
    return f"{r['step_ms']:.2f}/{roof or 0:.2f} ms{ratio} {r['path']}"


def print_table(res: dict) -> None:
    lim = res["limits"]
    print(
        f"\n== {res['gpu']} | torch {res['torch']} | copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s"
        f" | bf16 matmul {lim['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
        f" | fp8 matmul {lim['fp8_matmul_flops'] / 1e12:.0f} TFLOP/s"
    )
    g0 = (res.get("gemm") or [{"n": 0, "k": 0}])[0]
    title = f"gemm {g0['n']}x{g0['k']}"
    print(
        f"{title:<18} {'bf16 ms':>9} {'triton ms':>10} {'prequant':>9} {'scaled_mm':>10}"
        f" {'fp8 roof':>9}"
    )
    for g in res.get("gemm", []):
        sm = g.get("scaled_mm_fp8_ms")
        print(
            f"{g['tokens']:>18} {g['bf16_ms']:>9.3f} {g['triton_fp8_ms']:>10.3f}"
            f" {g['triton_fp8_prequant_ms']:>9.3f}"
            f" {'n/a' if sm is None else f'{sm:.3f}':>10} {g['fp8_roofline_ms']:>9.3f}"
            f"  {g['timing']}"
        )
    for model, m in res["models"].items():
        v = m["variants"]
        names = [n for n in VARIANTS if n in v]
        print(f"\n{model:<18} " + " ".join(f"{n:>34}" for n in names))
        for key, label, fmt in (
            ("weight_bytes", "weights GB", lambda x: f"{x / 1e9:.2f}"),
            ("kv_bytes_per_token", "KV B/token", str),
            ("fp8_activation_producers", "fp8 act producers", str),
        ):
            print(f"{label:<18} " + " ".join(f"{fmt(v[n][key]):>34}" for n in names))
        for i, (batch, ctx) in enumerate(m["decode_points"]):
            cells = [_cell(v[n]["decode"][i]) for n in names]
            print(f"{f'decode {batch}x{ctx}':<18} " + " ".join(f"{c:>34}" for c in cells))
        for i, n_tok in enumerate(m["prefill_lens"]):
            cells = []
            for n in names:
                p = v[n]["prefill"][i]
                cells.append(
                    "skipped"
                    if "skipped" in p
                    else f"{p['tok_s']:.0f} tok/s {p['share_of_matmul_peak']:.0%}bf"
                    f" {p['share_of_fp8_peak']:.0%}f8 x{p['ratio']:.2f}"
                )
            print(f"{f'prefill {n_tok}':<18} " + " ".join(f"{c:>34}" for c in cells))
        steps = [v[n].get("prefill_step", {}) for n in names]
        if any("tok_s" in p for p in steps):
            cells = [
                f"{p['tok_s']:.0f} tok/s {p['share_of_fp8_peak']:.0%}f8" if "tok_s" in p else "-"
                for p in steps
            ]
            print(f"{'prefill step':<18} " + " ".join(f"{c:>34}" for c in cells))
        print(
            f"{'offline out tok/s':<18} "
            + " ".join(f"{v[n]['offline']['output_tok_s']:>34.0f}" for n in names)
        )
        for n in names:  # where the prefill's device time goes, and the largest decode's
            pp = v[n].get("prefill_profile", {})
            if "categories" in pp:
                cats = ", ".join(f"{c} {ms:.1f}" for c, ms in pp["categories"].items())
                print(f"  {n} prefill {pp['tokens']} profile (ms): {cats}; idle "
                      f"{pp['idle_gap_ms']:.1f}; top: "
                      + ", ".join(f"{x['name'][:40]} {x['ms']:.1f}" for x in pp["top"][:4]))  # fmt: skip
            last = v[n]["decode"][-1] if v[n]["decode"] else {}
            if "kernels" in last:
                k = last["kernels"]
                print(f"  {n} decode {last['batch']}x{last['ctx']} kernels: "
                      f"{k['kernel_ms_per_step']:.2f} ms, {k['kernels_per_step']:.0f} a step; top: "
                      + ", ".join(f"{x['name'][:40]} {x['ms']:.3f}" for x in k["top"][:4]))  # fmt: skip
            off = v[n]["offline"]
            if "profile" in off:
                op = off["profile"]
                cats = ", ".join(f"{c} {ms:.0f}" for c, ms in op["categories"].items())
                if off["kernel_compiles"]:
                    print(f"  WARNING: {n} offline compiled {sorted(off['kernel_compiles'])} while timed")
                print(f"  {n} offline: {off['steps']} steps {off['step_paths']}; first pass "
                      f"compiled {off['first_pass_compiles'] or 'nothing'}; profiled "
                      f"span {op['span_ms']:.0f} ms: {cats}; idle {op['idle_gap_ms']:.0f}; top: "
                      + ", ".join(f"{x['name'][:40]} {x['ms']:.0f}" for x in op["top"][:5]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workdir", default="/tmp/pdserve-fp8-bench", help="config + tokenizer")
    ap.add_argument(
        "--kv-cache-gb",
        type=int,
        default=40,
        help="KV cache per engine, GiB (bf16 16 x 16K needs 33)",
    )
    ap.add_argument("--variants", default="bf16,fp8")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join(VARIANTS)})")
    cpu = args.device == "cpu"
    if cpu:  # the Triton GEMM in the interpreter: set before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if "pdserve.kernels.fp8_gemm" not in sys.modules:
            from _interp import interpreter_fix

            interpreter_fix()
    sizes, (shape, tokens) = (CPU_SIZES, CPU_GEMM) if cpu else (GPU_SIZES, GPU_GEMM)
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "models": {},
    }
    res["limits"] = measure_limits(args.device, sizes)
    res["limits"]["fp8_matmul_flops"] = fp8_matmul_peak(dev, sizes.matmul_m)
    print(json.dumps(res["limits"]), flush=True)
    res["gemm"] = bench_gemm(res["limits"], dev, shape, tokens)
    if not cpu:
        torch.cuda.empty_cache()
    print(json.dumps(res["gemm"]), flush=True)
    for model in models:
        arch, preset, gpu_points, cpu_points = MODELS[model]
        points = cpu_points if cpu else gpu_points
        ckpt = make_checkpoint(
            arch, "tiny" if cpu else preset, Path(args.workdir) / model, config_only=True
        )
        glm = arch != "LlamaForCausalLM"
        m: dict = {
            "decode_points": points,
            "prefill_lens": CPU_PREFILL_LENS if cpu else PREFILL_LENS,
            "variants": {},
        }
        res["models"][model] = m
        for name in args.variants.split(","):
            try:
                m["variants"][name] = bench_variant(
                    ckpt, name, res["limits"], args, sizes, points, glm
                )
            except Exception as e:
                res[f"{model}_{name}_error"] = f"{type(e).__name__}: {e}"
                print(model, name, "failed:", res[f"{model}_{name}_error"], flush=True)
            Path(args.out).write_text(json.dumps(res, indent=2))  # partial results survive
    res["seconds"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(res, indent=2))
    print_table(res)
    print(f"\n{res['seconds']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
