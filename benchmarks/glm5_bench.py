"""The GLM-5 family on the GPU (issue 13): correctness at real shapes, and reference-path
speed next to transformers and the roofline; ``--profile``: where a decode step's time goes.

    python3 benchmarks/glm5_bench.py --out $OUT/glm5.json [--sections accuracy,speed]
                                     [--presets glm5-s4-e16,glm5-m12-e64] [--long]
    python3 benchmarks/glm5_bench.py --out $OUT/glm5_profile.json --presets glm5-m12-e64 \
                                     --long --profile 1x1024,32x1024
    python3 benchmarks/glm5_bench.py --out /tmp/glm5_cpu.json --device cpu --profile   (smoke)

accuracy  glm5-s4-e16 (written on the GPU): pdserve bf16 against transformers fp32 on one
          2560-token prompt (longer than index_topk 2048, so DSA decides), with
          transformers' own bf16 error as the yardstick: mean KL(fp32 || x) over positions,
          argmax agreement, and the indexer's top-2048 overlap per layer (rows >= 2048)
speed     per preset: decode step at batch 1 and 32 with 1K and 16K contexts (graphs on;
          ``--long``: also batch 8 with 128K), and one 16K prompt's prefill. A case adds
          its requests, steps until all of them decode, and times 12 steps in which every
          one of them runs (``live`` in the table: the fewest that ran in a timed step;
          requests may generate up to max_model_len, so none finishes early). The roofline
          is the bytes the step must read (:mod:`pdserve.profiling.decode_roofline`: weights
          but the embedding and MTP layers, the routed experts the batch's tokens reach,
          min(context, index_topk) latents per layer, indexer keys in the layers that run
          their indexer and only for contexts above index_topk) over the copy bandwidth
          measured now. The experts reached are counted in one eager step of the batch
          after the timed ones ("roof ms"); "uniform-routing roof ms" assumes independent
          uniform routing instead. transformers' GlmMoeDsaForCausalLM (bf16, eager) on the
          same preset where it fits. glm5-m12-e64 is drawn on the device (--load-format
          dummy; 53 GB does not fit the disk); transformers' copy gets its own random init
prefill   per preset (``--prefill-lens``, default 4096,16384,65536 on the GPU; prompts longer
          than max_model_len are skipped, so give ``--long`` for 64K): one prompt's
          prefill timed (one untimed prompt first, which compiles, then the median of
          three distinct prompts; prefix-cache hits counted, they must be 0), then another
          prompt profiled: device time by kernel category
          and, per category, the achieved TFLOP/s and its share of the bf16 matmul rate
          measured in the same call (FLOP formulas: :mod:`pdserve.profiling.prefill_flops`),
          and its share of the rate bf16 matmuls sustain over 1.5 s (``sustained_matmul``:
          the burst rate is the boost clock's, the prefill runs at the power cap's);
          transformers' prefill of the same config where it fits (``--no-peer``: not)
profile   per point BxCTX, the same steady batch, then one profiled step each
          (:mod:`pdserve.profiling.step_profile`): the CUDA-graph replay, the captured forward
          run eagerly (same kernels; module ranges name their categories, which the
          replay's kernels inherit in order), and a plain eager step (graphs off: the
          step's own metadata). Device time by category (MoE experts, router, MLA
          attention, indexer score, top-k select, dense GEMMs, norms/RoPE, other) and
          the idle gap, as shares of the step's device span.
``--device cpu`` runs speed and profile on the tiny GLM-5 preset (index_topk 16; contexts
8 and 40; one thread) with the torch reference paths: a smoke run of the code, not a
measurement (operators' CPU self time stands in for kernels).

Every number goes to the JSON file; a table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_clock import ClockSampler, sustained_matmul  # noqa: E402
from gpu_suite import measure_limits  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.layers.attention import CommonAttentionMetadata  # noqa: E402
from pdserve.layers.attention.dsa import Indexer  # noqa: E402
from pdserve.profiling.decode_roofline import DecodeByteModel  # noqa: E402
from pdserve.profiling.prefill_flops import PrefillFlopModel  # noqa: E402
from pdserve.profiling.step_profile import align_categories, format_tables, profile_step  # noqa: E402
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

ARCH = "GlmMoeDsaForCausalLM"
TOPK = 2048  # the accuracy section's index_topk (glm5-s4-e16)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt(n: int, seed: int, vocab: int = 150000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


# ------------------------------------------------------------------------- accuracy
def _our_logits(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One prefill of ``ids`` through the engine's model step (blocks 1.. of the idle
    engine's cache): logits of every position, and each indexer's selection."""
    r = llm.engine.runner
    step, buf = r.step, r.buffers
    n, bs = len(ids), r.block_size
    nblk = -(-n // bs)
    dev = r.device
    tops: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: tops.append(out.clone()))
        for m in r.model.modules()
        if isinstance(m, Indexer)
    ]
    buf.input_ids.dev[:n] = torch.tensor(ids, device=dev)
    buf.positions.dev[:n] = torch.arange(n, device=dev)
    md = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        block_size=bs,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(1, nblk + 1, dtype=torch.int32, device=dev)[None],
        slot_mapping=torch.arange(bs, bs + n, device=dev),
        token_req_idx=torch.zeros(n, dtype=torch.int64, device=dev),
        token_q_idx=torch.arange(n, device=dev),
    )
    with torch.inference_mode():
        logits = step.logits(step.hidden(md))
    for h in hooks:
        h.remove()
    return logits.float(), tops


def _hf_logits(path: Path, ids: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, list]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    ).cuda()
    tops: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, a, out: tops.append(out[0].clone()))
        for layer in hf.model.layers
        if layer.self_attn.indexer is not None
    ]
    with torch.inference_mode():
        logits = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    for h in hooks:
        h.remove()
    del hf
    _free()
    return logits, tops


def _compare(ref: torch.Tensor, got: torch.Tensor, ref_top: list, got_top: list) -> dict:
    lp_ref, lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    overlap = []
    for a, b in zip(ref_top, got_top, strict=True):
        rows = range(TOPK, a.shape[0])  # rows with a full selection
        per = [len(set(a[t].tolist()) & set(b[t].tolist())) / TOPK for t in rows]
        overlap.append(statistics.mean(per))
    return {
        "kl_mean": float(kl.mean()),
        "argmax_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        "mean_abs_logit_diff": float((ref - got).abs().mean()),
        "indexer_overlap_per_layer": overlap,
    }


def bench_accuracy(workdir: Path) -> dict:
    path = workdir / "glm5-s4-e16"
    if not (path / "config.json").is_file():
        t0 = time.perf_counter()
        make_checkpoint(ARCH, "glm5-s4-e16", path, dtype="bfloat16", device="cuda")
        print(f"glm5-s4-e16 written in {time.perf_counter() - t0:.1f}s", flush=True)
    ids = _prompt(2560, 0)
    llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, max_model_len=4096, max_num_seqs=4)
    ours, our_top = _our_logits(llm, ids)
    ours, our_top = ours.cpu(), [t.cpu() for t in our_top]
    del llm
    _free()
    ref, ref_top = _hf_logits(path, ids, torch.float32)
    ref, ref_top = ref.cpu(), [t.cpu() for t in ref_top]
    hf16, hf16_top = _hf_logits(path, ids, torch.bfloat16)
    return {
        "prompt_tokens": len(ids),
        "pdserve_bf16_vs_hf_fp32": _compare(ref, ours, ref_top, our_top),
        "hf_bf16_vs_hf_fp32": _compare(ref, hf16.cpu(), ref_top, [t.cpu() for t in hf16_top]),
    }


# ---------------------------------------------------------------------------- speed
LONG_CTX = 131072
CPU_PRESET = "tiny"  # --device cpu: the CPU-sized GLM-5 (index_topk 16, 8 experts)
CPU_CASES = [(1, 8), (3, 40)]  # one context within index_topk over the steps, one above it
CPU_LIMITS = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


def _sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def _engine(preset: str, workdir: Path, long: bool, device: str,
            budget: int = 8192, fp8: bool = False) -> tuple[LLM, bool, float]:  # fmt: skip
    """The preset's engine (graphs on where the device has them), whether its weights
    were drawn at load (``dummy``), and its start-up seconds. ``fp8``: weights quantized
    to block FP8 as they load and an fp8 KV cache (fp8_bench's fp8 variant)."""
    cpu = device == "cpu"
    quant: dict = {"quantization": "fp8", "kv_cache_dtype": "fp8"} if fp8 else {}
    path = workdir / preset
    dummy = preset not in ("glm5-s4-e16", CPU_PRESET)
    if not (path / "config.json").is_file():
        make_checkpoint(
            ARCH,
            preset,
            path,
            dtype="float32" if cpu else "bfloat16",
            device="cpu" if cpu else "cuda",
            config_only=dummy,
        )
    t0 = time.perf_counter()
    if cpu:
        llm = LLM(str(path), dtype="float32", device="cpu", **CPU_LIMITS, **quant)  # type: ignore[arg-type]
        return llm, dummy, time.perf_counter() - t0
    llm = LLM(
        str(path),
        dtype="bfloat16",
        load_format="dummy" if dummy else "auto",
        max_model_len=(LONG_CTX if long else 16384) + 256,
        max_num_seqs=32,
        max_num_batched_tokens=budget,
        gpu_memory_utilization=0.9,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
        **quant,
    )
    return llm, dummy, time.perf_counter() - t0


def _byte_model(llm: LLM) -> DecodeByteModel:
    r = llm.engine.runner
    return DecodeByteModel.from_model(r.model, r.kv_cache_config)


def _seed(batch: int, ctx: int, i: int) -> int:
    """Distinct prompts for every case: no prefix-cache hit between cases."""
    return 1_000_003 * batch + 7919 * ctx + i


def _fill_batch(llm: LLM, batch: int, ctx: int) -> tuple[list[str], float]:
    """Add ``batch`` requests of ``ctx`` prompt tokens and step until every one of them
    decodes (chunked prefills interleave with the decodes of those already done), then
    two more steps. Each may generate up to ``max_model_len``, so none finishes before
    the caller aborts it: with ``max_tokens`` fixed small, the first requests of a long
    batch (32 x 16K: 64 steps of prefill) ran out while the last were still prefilling,
    and the timed steps decoded only a few of them. Returns (request ids, seconds)."""
    eng = llm.engine
    room = eng.max_model_len - ctx
    sp = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    ids = [f"d{batch}x{ctx}-{i}" for i in range(batch)]
    vocab = min(150000, eng.vocab_size)
    for i, rid in enumerate(ids):
        prompt = _prompt(ctx, _seed(batch, ctx, i), vocab)
        eng.add_request(llm.processor.make_request(rid, prompt, sp))
    reqs = eng.scheduler.requests
    t0 = time.perf_counter()
    while eng.scheduler.waiting or any(not reqs[r].output_token_ids for r in ids if r in reqs):
        eng.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(2):
        eng.step()
    _sync(llm)
    return ids, prefill_s


def _live(llm: LLM, ids: list[str]) -> int:
    running = {r.request_id for r in llm.engine.scheduler.running}
    return sum(rid in running for rid in ids)


def _contexts(llm: LLM, ids: list[str]) -> list[int]:
    reqs = llm.engine.scheduler.requests
    return [reqs[r].num_tokens if r in reqs else 0 for r in ids]


def _timed_steps(llm: LLM, ids: list[str], steps: int) -> dict:
    """Time ``steps`` engine steps of the batch; each request's context over them (the
    mean of before and after), how many of the batch each step ran, the graph replays
    and the preemptions among them."""
    eng = llm.engine
    before = eng.stats()
    ctx0 = _contexts(llm, ids)
    times, live = [], []
    for _ in range(steps):
        live.append(_live(llm, ids))
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    _sync(llm)
    after = eng.stats()
    ctx1 = _contexts(llm, ids)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "live_min": min(live),
        "live_max": max(live),
        "graph_steps": after.step_paths.get("graph", 0) - before.step_paths.get("graph", 0),
        "preemptions": after.num_preemptions - before.num_preemptions,
        "seq_lens": [(a + b) / 2 for a, b in zip(ctx0, ctx1, strict=True)],
    }


@contextmanager
def _graphs_off(llm: LLM) -> Iterator[None]:
    """Steps run eagerly (the path ``enforce_eager`` gives: ``eager:graphs_off``), with
    the step's own metadata (``max_seq_len`` the batch's longest context)."""
    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


@contextmanager
def _graph_forward_eager(llm: LLM) -> Iterator[None]:
    """Steps that would replay a graph run the captured forward eagerly instead: the
    graph's padded batch and metadata (``max_seq_len`` = ``max_model_len``), so the same
    kernels as the replay, launched one by one where module ranges can see them."""
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    graphs.replay = graphs._forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del graphs.replay


@contextmanager
def _routing(llm: LLM, rows: int) -> Iterator[list[torch.Tensor]]:
    """Collect each target MoE layer's expert ids of the first ``rows`` tokens."""
    from pdserve.layers.moe import TopKRouter
    from pdserve.profiling.decode_roofline import layer_index

    r = llm.engine.runner
    n = int(r.hf_config.num_hidden_layers)
    got: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda mod, a, out: got.append(out[1][:rows].detach().clone()))
        for name, m in r.model.named_modules()
        if isinstance(m, TopKRouter) and (layer_index(name) or 0) < n
    ]
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


def _active(ids: list[torch.Tensor]) -> list[int]:
    return [int(t.unique().numel()) for t in ids]


def _routing_step(llm: LLM, ids: list[str]) -> list[int]:
    """One eager step of the batch (no padding rows): distinct experts per MoE layer."""
    with _graphs_off(llm), _routing(llm, len(ids)) as got:
        llm.engine.step()
        _sync(llm)
    return _active(got)


def _drop(llm: LLM, ids: list[str]) -> None:
    eng = llm.engine
    eng.abort_requests([r for r in ids if r in eng.scheduler.requests])
    for _ in range(3):
        eng.step()


def _roofline(
    bm: DecodeByteModel, seq_lens: list[float], active: list[int], bw: float | None
) -> dict:
    taken = bm.step_bytes(seq_lens, active)
    uniform = bm.step_bytes(seq_lens)
    out: dict = {
        "active_experts": active,
        "bytes": {k: v for k, v in taken.items()},
        "bytes_uniform_routing": uniform["total"],
        "mean_seq_len": statistics.mean(seq_lens),
    }
    if bw:
        out["roofline_ms"] = taken["total"] / bw * 1e3
        out["roofline_uniform_ms"] = uniform["total"] / bw * 1e3
    return out


def _decode(llm: LLM, bm: DecodeByteModel, batch: int, ctx: int, bw: float | None,
            steps: int = 12) -> dict:  # fmt: skip
    ids, prefill_s = _fill_batch(llm, batch, ctx)
    timed = _timed_steps(llm, ids, steps)
    active = _routing_step(llm, ids)
    _drop(llm, ids)
    r = {"batch": batch, "ctx": ctx, "prefill_s_all": prefill_s, **timed}
    r.update(_roofline(bm, timed["seq_lens"], active, bw))
    del r["seq_lens"]
    if "roofline_ms" in r:
        r["ratio"] = r["step_ms"] / r["roofline_ms"]
    if timed["live_min"] < batch or timed["preemptions"]:
        r["warning"] = (
            f"only {timed['live_min']} of {batch} requests ran in some timed step "
            f"({timed['preemptions']} preemptions): the step is not a {batch}-request step"
        )
        print(f"WARNING {batch}x{ctx}: {r['warning']}", flush=True)
    return r


def _hf_speed(path: Path, dummy: bool, cases: list[tuple[int, int]]) -> dict:
    """transformers' model, bf16 eager: prefill 16K and decode steps (a chunked prefill
    fills its cache first); OOM is reported, not fatal."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    if dummy:
        with torch.device("cuda"):
            hf = transformers.GlmMoeDsaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    hf.eval()
    out: dict = {"decode": []}
    try:
        ids = torch.tensor([_prompt(16384, 3)], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        out["prefill_16k_s"] = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        out["prefill_16k_s"] = "OOM"
    _free()
    for batch, ctx in cases:
        try:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=hf.config)
            ids = torch.tensor([_prompt(ctx, 20 + b) for b in range(batch)], device="cuda")
            with torch.inference_mode():
                for a in range(0, ctx, 2048):  # chunked prefill
                    hf(ids[:, a : a + 2048], cache=cache, use_cache=True, logits_to_keep=1)
                tok = ids[:, -1:]
                times = []
                for _ in range(4):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    lg = hf(tok, cache=cache, use_cache=True).logits
                    tok = lg[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
            out["decode"].append(
                {"batch": batch, "ctx": ctx, "step_ms": statistics.median(times[1:]) * 1e3}
            )
        except torch.OutOfMemoryError:
            out["decode"].append({"batch": batch, "ctx": ctx, "step_ms": "OOM"})
        _free()
    del hf
    _free()
    return out


def bench_speed(llm: LLM, preset: str, bw: float | None, long: bool = False) -> dict:
    cpu = llm.engine.runner.device.type == "cpu"
    res: dict = {"preset": preset, "decode": []}
    bm = _byte_model(llm)
    res["weight_bytes_per_step"] = bm.dense_weight_bytes
    res["expert_bytes_per_layer"] = [e * bm.num_experts for e in bm.expert_bytes]
    if cpu:
        cases, steps = CPU_CASES, 3
    else:
        cases = [(1, 1024), (32, 1024), (1, 16384), (32, 16384)] + ([(8, LONG_CTX)] if long else [])
        steps = 12
    for batch, ctx in cases:
        r = _decode(llm, bm, batch, ctx, bw, steps)
        res["decode"].append(r)
        print(json.dumps(r), flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    n = 64 if cpu else 16384
    ids = _prompt(n, 99, min(150000, llm.engine.vocab_size))
    _sync(llm)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], sp)
    _sync(llm)
    res["prefill_tokens"], res["prefill_s"] = n, time.perf_counter() - t0
    if n == 16384:
        res["prefill_16k_s"] = res["prefill_s"]  # the key earlier runs wrote
    return res


# -------------------------------------------------------------------------- prefill
PREFILL_LENS = (4096, 16384, 65536)
HF_PREFILL_LENS = (4096, 8192)  # transformers' eager attention holds heads x n x n scores
CPU_PREFILL_LENS = (12, 40)  # within and beyond the tiny preset's index_topk 16


def _prefill_once(llm: LLM, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, prefix-cache hit tokens, engine steps) of one prompt's prefill."""
    eng = llm.engine
    before = eng.stats()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _sync(llm)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], sp)
    _sync(llm)
    sec = time.perf_counter() - t0
    after = eng.stats()
    steps = sum(after.step_paths.values()) - sum(before.step_paths.values())
    return sec, after.prefix_cache_hits - before.prefix_cache_hits, steps


def bench_prefill(llm: LLM, preset: str, lens: list[int], peak: float | None) -> dict:
    """Prefill speed and its kernel categories against their FLOPs (module docstring)."""
    eng, runner = llm.engine, llm.engine.runner
    fm = PrefillFlopModel.from_model(runner.model)
    vocab = min(150000, eng.vocab_size)
    res: dict = {"preset": preset, "points": [],
                 "budget_tokens": eng.scheduler.config.max_num_batched_tokens}  # fmt: skip
    for n in lens:
        if n + 1 > eng.max_model_len:
            res["points"].append({"tokens": n, "skipped": f"max_model_len {eng.max_model_len}"})
            continue
        warm = _prefill_once(llm, _prompt(n, 499 + 3 * n, vocab))  # compiles: untimed
        with ClockSampler(runner.device) as clock:  # the SM clock the prefills ran at
            runs = [_prefill_once(llm, _prompt(n, 500 + 3 * n + i, vocab)) for i in range(3)]
        flops = fm.flops(n)
        prof = profile_step(lambda n=n: _prefill_once(llm, _prompt(n, 7 * n + 1, vocab)),
                            runner.model, runner.device).table(top_n=40)  # fmt: skip
        cats = {}
        for cat, v in prof["categories"].items():
            f = flops.get(cat, 0.0)
            row = {"ms": v["ms"], "count": v["count"], "tflop": f / 1e12}
            if f and v["ms"]:
                row["tflops"] = f / (v["ms"] * 1e-3) / 1e12
                if peak:
                    row["share_of_matmul"] = f / (v["ms"] * 1e-3) / peak
            cats[cat] = row
        sec = statistics.median(r[0] for r in runs)
        point = {
            "tokens": n,
            "seconds": sec,
            "tok_per_s": n / sec,
            "runs_s": [r[0] for r in runs],
            "warmup_s": warm[0],
            "prefix_cache_hits": sum(r[1] for r in runs),
            "steps": [r[2] for r in runs],
            "flops": flops,
            "tflops_overall": flops["total"] / sec / 1e12,
            "clock": clock.summary(),
            "profile": {"span_ms": prof["span_ms"], "wall_ms": prof["wall_ms"],
                        "kernels": prof["kernels"], "idle_gap_ms": prof["idle_gap"]["ms"],
                        "categories": cats, "top": prof["top"],
                        "diagnostics": prof["diagnostics"]},  # fmt: skip
        }
        if all(r[2] == 1 for r in runs):  # one step: each layer's call sees the whole prompt
            point["mla_alone"] = _mla_alone(llm, _prompt(n, 7 * n + 2, vocab), prof["top"],
                                            fm.attention_layers, peak)  # fmt: skip
        res["points"].append(point)
        print(json.dumps({k: v for k, v in point.items() if k != "profile"}), flush=True)
    _against_sustained(res, runner.device)
    return res


def _against_sustained(res: dict, device: torch.device) -> None:
    """The bf16 matmul rate the card sustains for as long as a prefill (the burst rate
    of ``measure_limits`` runs at the boost clock; a 16K prefill holds the H200 at its
    700 W cap, RESULTS.md run 137), and each category's share of it beside the burst
    share."""
    cuda = device.type == "cuda"
    sus = sustained_matmul(device, 1.5 if cuda else 0.05, 8192 if cuda else 64)
    res["sustained_matmul"] = sus
    print(json.dumps({"sustained_matmul": sus}), flush=True)
    for p in res["points"]:
        for row in p.get("profile", {}).get("categories", {}).values():
            if "tflops" in row:
                row["share_of_sustained"] = row["tflops"] * 1e12 / sus["flops"]
        alone = p.get("mla_alone", {})
        if "flop" in alone:
            alone["share_in_model_sustained"] = alone["flop"] / (alone["in_model_ms"] * 1e-3) / sus["flops"]


def _mla_alone(llm: LLM, prompt: list[int], top: list[dict], layers: int,
               peak: float | None) -> dict:  # fmt: skip
    """The sparse MLA prefill kernel timed alone on the first layer's operands of one more
    prefill of the prompt (benchmarks/_mla_probe.py), beside its mean time a layer in the
    profile (the candidate-row kernel left out of both)."""
    import _mla_probe

    from pdserve.layers.attention.mla_triton import MLATritonBackend

    got = _mla_probe.capture(MLATritonBackend, lambda: _prefill_once(llm, prompt))
    if got is None:
        return {"skipped": "no sparse MLA prefill call (another attention backend ran)"}
    with ClockSampler(llm.engine.runner.device) as clock:
        alone = _mla_probe.time_alone(*got)
    del got
    _free()
    kernels = [t for t in top if t["category"] == "mla_attention" and "_rows_" not in t["name"]]
    in_model = sum(t["ms"] for t in kernels) / layers
    out = {**alone, "in_model_ms": in_model, "alone_over_in_model": alone["ms"] / in_model,
           "clock_alone": clock.summary()}  # fmt: skip
    if peak:
        out["share_alone"] = alone["flop"] / (alone["ms"] * 1e-3) / peak
        out["share_in_model"] = alone["flop"] / (in_model * 1e-3) / peak
    print(json.dumps({"mla_alone": out}), flush=True)
    return out


def _hf_prefill(path: Path, lens: list[int]) -> dict:
    """transformers' GlmMoeDsaForCausalLM (bf16, eager, random init) prefilling the same
    lengths: seconds, or "OOM"."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        hf = transformers.GlmMoeDsaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    hf.eval()
    out: dict = {}
    for n in lens:
        try:
            ids = torch.tensor([_prompt(n, 11 + n)], device="cuda")
            with torch.inference_mode():
                hf(ids[:, :256], logits_to_keep=1)  # warm-up
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf(ids, logits_to_keep=1)
                torch.cuda.synchronize()
            out[str(n)] = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            out[str(n)] = "OOM"
        _free()
    del hf
    _free()
    return out


# -------------------------------------------------------------------------- profile
def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x1024,32x1024"`` -> [(1, 1024), (32, 1024)] (batch x context)."""
    out = []
    for item in text.split(","):
        b, _, c = item.strip().lower().partition("x")
        if not (b.isdigit() and c.isdigit()):
            raise ValueError(f"profile point {item!r} is not BATCHxCTX (e.g. 32x1024)")
        out.append((int(b), int(c)))
    return out


def profile_point(llm: LLM, bm: DecodeByteModel, batch: int, ctx: int, bw: float | None,
                  steps: int = 4) -> dict:  # fmt: skip
    """A steady decode batch of ``batch`` x ``ctx``: a few timed steps, then one profiled
    step of each kind: the graph replay, the captured forward run eagerly (same kernels,
    module ranges visible; its categories name the replay's kernels), and a plain eager
    step (graphs off: the step's own metadata, e.g. the indexer's sort-free path for
    short contexts). Device time by category with the idle gap, per kind."""
    eng, runner = llm.engine, llm.engine.runner
    ids, prefill_s = _fill_batch(llm, batch, ctx)
    timed = _timed_steps(llm, ids, steps)
    was_async = eng.scheduler.async_scheduling
    eng.set_async_scheduling(False)  # one call = one whole step while profiling
    dev, model = runner.device, runner.model
    cols: dict[str, dict] = {}
    try:
        if runner.graphs is not None:
            with _graph_forward_eager(llm):
                shaped = profile_step(eng.step, model, dev)
            graph = profile_step(eng.step, None, dev)
            align_categories(graph, shaped)
            if len(graph.spans) < len(shaped.spans) // 2:
                graph.notes.append("the profiler saw few kernels inside the graph replay")
            cols["graph replay"] = graph.table()
            cols["eager, graph shape"] = shaped.table()
        with _graphs_off(llm), _routing(llm, batch) as got:
            plain = profile_step(eng.step, model, dev)
        cols["eager"] = plain.table()
    finally:
        eng.set_async_scheduling(was_async)
    active = _active(got)
    _drop(llm, ids)
    out = {"batch": batch, "ctx": ctx, "prefill_s_all": prefill_s, **timed, "steps": cols}
    out.update(_roofline(bm, timed["seq_lens"], active, bw))
    del out["seq_lens"]
    if "roofline_ms" in out:
        out["ratio"] = out["step_ms"] / out["roofline_ms"]
    return out


def bench_profile(llm: LLM, preset: str, points: list[tuple[int, int]], bw: float | None) -> dict:
    bm = _byte_model(llm)
    res: dict = {"preset": preset, "points": []}
    for batch, ctx in points:
        t0 = time.perf_counter()
        p = profile_point(llm, bm, batch, ctx, bw)
        p["seconds"] = time.perf_counter() - t0
        res["points"].append(p)
        _print_profile(preset, p)
    return res


def _print_profile(preset: str, p: dict) -> None:
    roof = f", roofline {p['roofline_ms']:.2f} ms" if "roofline_ms" in p else ""
    print(
        f"\n{preset} {p['batch']}x{p['ctx']}: step {p['step_ms']:.2f} ms "
        f"({p['graph_steps']} graph replays of {p['live_min']}..{p['live_max']} requests)"
        f"{roof}; active experts per MoE layer {p['active_experts']}"
    )
    print(format_tables(p["steps"]))
    for name, t in p["steps"].items():
        for note in t["notes"]:
            print(f"  {name}: {note}")
        tops = "; ".join(
            f"{k['name'][:48]} ({k['category']}) {k['ms']:.3f} ms" for k in t["top"][:5]
        )
        print(f"  {name} top: {tops}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--sections",
        default=None,
        help="accuracy,speed,prefill,profile (default accuracy,speed; with --profile: profile)",
    )
    ap.add_argument("--presets", default=None, help="default glm5-s4-e16,glm5-m12-e64 (CPU: tiny)")
    ap.add_argument("--workdir", default="/tmp/glm5")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' speed runs")
    ap.add_argument(
        "--long",
        action="store_true",
        help="max_model_len 128K + 256 (else 16K + 256), and speed also decodes 8 x 128K; "
        "the graphs' indexer scores max_model_len-wide rows, so profile with the same flag "
        "as the run it explains",
    )
    ap.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="BxCTX,...",
        help="profile decode steps at these points (default 1x1024,32x1024; CPU: "
        + ",".join(f"{b}x{c}" for b, c in CPU_CASES)
        + ")",
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--budget", type=int, default=8192,
                    help="max_num_batched_tokens of the GPU engine (the serve default: 8192)")
    ap.add_argument("--prefill-lens", type=lambda t: [int(x) for x in t.split(",")],
                    default=None, help="prompt lengths of the prefill section")  # fmt: skip
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 weights (quantized at load) and an fp8 KV cache")  # fmt: skip
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = device == "cpu"
    sections = args.sections or ("profile" if args.profile is not None else "accuracy,speed")
    sections = sections.split(",")
    if cpu and "accuracy" in sections:
        sys.exit("the accuracy section needs a GPU (transformers fp32 at real shapes)")
    presets = (args.presets or (CPU_PRESET if cpu else "glm5-s4-e16,glm5-m12-e64")).split(",")
    if args.profile:
        points = parse_points(args.profile)
    else:
        points = CPU_CASES if cpu else [(1, 1024), (32, 1024)]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if cpu:  # a smoke run: two-thread ops stall for milliseconds on a shared CPU
        torch.set_num_threads(1)
    try:
        res = _run(args, sections, presets, points, workdir, device)
    finally:
        torch.set_num_threads(threads)
    Path(args.out).write_text(json.dumps(res, indent=2))
    _table(res)


def _run(args: argparse.Namespace, sections: list[str], presets: list[str],
         points: list[tuple[int, int]], workdir: Path, device: str) -> dict:  # fmt: skip
    cpu = device == "cpu"
    res: dict = {"gpu": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__}
    res["limits"] = {} if cpu else measure_limits()
    bw = res["limits"].get("copy_bandwidth_Bps")
    if "accuracy" in sections:
        res["accuracy"] = bench_accuracy(workdir)
        print(json.dumps(res["accuracy"]), flush=True)
    peak = res["limits"].get("bf16_matmul_flops")
    for preset in presets:
        if not {"speed", "profile", "prefill"} & set(sections):
            break
        llm, dummy, startup = _engine(preset, workdir, args.long, device, args.budget, args.fp8)
        pf = None
        if "prefill" in sections:
            lens = args.prefill_lens or (CPU_PREFILL_LENS if cpu else PREFILL_LENS)
            pf = bench_prefill(llm, preset, list(lens), peak)
            pf["startup_s"] = startup
            res.setdefault("prefill", []).append(pf)
        if "profile" in sections:
            prof = bench_profile(llm, preset, points, bw)
            prof["startup_s"] = startup
            res.setdefault("profile", []).append(prof)
        sp = None
        if "speed" in sections:
            sp = bench_speed(llm, preset, bw, args.long)
            sp["startup_s"] = startup
            res.setdefault("speed", []).append(sp)
        del llm
        if cpu:
            continue
        _free()
        if sp is not None and not args.no_peer:  # after the engine is gone: memory
            cases = [(1, 1024), (32, 1024), (1, 16384)]
            sp["transformers"] = _hf_speed(workdir / preset, dummy, cases)
        if pf is not None and not args.no_peer:
            pf["transformers"] = _hf_prefill(workdir / preset, list(HF_PREFILL_LENS))
    return res


def _table(res: dict) -> None:
    lim = res["limits"]
    bw = lim.get("copy_bandwidth_Bps")
    copy = f" | copy {bw / 1e12:.2f} TB/s" if bw else ""
    print(f"\n== {res['gpu']} | torch {res['torch']}{copy}")
    acc = res.get("accuracy")
    if acc:
        for k in ("pdserve_bf16_vs_hf_fp32", "hf_bf16_vs_hf_fp32"):
            a = acc[k]
            ov = ", ".join(f"{x:.3f}" for x in a["indexer_overlap_per_layer"])
            print(
                f"{k:26s} KL {a['kl_mean']:.4f}  argmax {a['argmax_agreement']:.3f}  "
                f"mean|dlogit| {a['mean_abs_logit_diff']:.3f}  indexer overlap {ov}"
            )
    for sp in res.get("speed", []):
        print(
            f"\n{sp['preset']}: start-up {sp['startup_s']:.0f}s, prefill "
            f"{sp['prefill_tokens']} tokens {sp['prefill_s']:.2f}s"
        )
        print(
            " batch    ctx   step ms   roof ms  ratio  uniform-routing roof ms  live  graph steps"
            "  experts/layer  GB read"
        )
        for r in sp["decode"]:
            roof = r.get("roofline_ms", float("nan"))
            uni = r.get("roofline_uniform_ms", float("nan"))
            print(
                f"{r['batch']:6d} {r['ctx']:6d} {r['step_ms']:9.2f} {roof:9.2f} "
                f"{r.get('ratio', float('nan')):6.2f} {uni:24.2f} {r['live_min']:5d} "
                f"{r['graph_steps']:12d} {statistics.mean(r['active_experts']):14.1f} "
                f"{r['bytes']['total'] / 1e9:8.3f}"
            )
        hf = sp.get("transformers")
        if hf:
            dec = ", ".join(f"{d['batch']}x{d['ctx']}: {_ms(d['step_ms'])}" for d in hf["decode"])
            print(f" transformers: prefill 16K {hf['prefill_16k_s']}, decode {dec}")
    for pf in res.get("prefill", []):
        _prefill_table(pf, lim.get("bf16_matmul_flops"))
    for pr in res.get("profile", []):  # the tables were printed as each point finished
        print(f"\n{pr['preset']} profile (start-up {pr['startup_s']:.0f}s):")
        for p in pr["points"]:
            roof = p.get("roofline_ms", float("nan"))
            kind = "graph replay" if "graph replay" in p["steps"] else "eager"
            shares = ", ".join(f"{c} {v['share'] * 100:.0f}%" for c, v in _shares(p["steps"][kind]))
            print(
                f"  {p['batch']}x{p['ctx']}: step {p['step_ms']:.2f} ms, roofline {roof:.2f} ms, "
                f"profiled in {p['seconds']:.1f}s; {kind}: {shares}"
            )


def _prefill_table(pf: dict, peak: float | None) -> None:
    rate = f", bf16 matmul {peak / 1e12:.0f} TFLOP/s" if peak else ""
    print(f"\n{pf['preset']} prefill (budget {pf['budget_tokens']} tokens a step{rate}; "
          "per category: ms / TFLOP/s / share of the matmul rate):")  # fmt: skip
    cats = ("mla_attention", "indexer_score", "topk_select", "moe_experts", "dense_gemm",
            "router", "norm_rope", "other")  # fmt: skip
    print(f"{'tokens':>7} {'s':>7} {'tok/s':>8} {'hits':>5} {'gap ms':>7} "
          + " ".join(f"{c:>22}" for c in cats))  # fmt: skip
    for p in pf["points"]:
        if "seconds" not in p:
            print(f"{p['tokens']:7d} skipped: {p['skipped']}")
            continue
        pc = p["profile"]["categories"]
        cells = []
        for c in cats:
            v = pc.get(c, {})
            tf = f"{v['tflops']:.0f}" if "tflops" in v else "-"
            sh = f"{v['share_of_matmul'] * 100:.0f}%" if "share_of_matmul" in v else "-"
            cells.append(f"{v.get('ms', 0.0):9.1f}/{tf:>5}/{sh:>5}")
        print(f"{p['tokens']:7d} {p['seconds']:7.3f} {p['tok_per_s']:8.0f} "
              f"{p['prefix_cache_hits']:5d} {p['profile']['idle_gap_ms']:7.1f} " + " ".join(cells))
        mla = pc.get("mla_attention", {})
        if "share_of_sustained" in mla:
            print(f"{'':7} sparse MLA {mla['share_of_sustained'] * 100:.1f}% of the sustained rate "
                  f"(SM clock {p['clock'].get('sm_mhz_median', '-')} MHz in the prefills)")
    sus = pf.get("sustained_matmul")
    if sus:
        print(f" sustained bf16 matmul ({sus['seconds']:.1f} s of {sus['m']}^3): "
              f"{sus['flops'] / 1e12:.0f} TFLOP/s at {sus['clock'].get('sm_mhz_median', '-')} MHz, "
              f"{sus['clock'].get('power_w_median', '-')} W")
    hf = pf.get("transformers")
    if hf:
        print(" transformers prefill: " + ", ".join(f"{k}: {_ms(v * 1e3 if isinstance(v, float) else v)}"
                                                   for k, v in hf.items()))  # fmt: skip


def _shares(table: dict) -> list[tuple[str, dict]]:
    """The categories and the idle gap, largest share first."""
    items = [*table["categories"].items(), ("idle_gap", table["idle_gap"])]
    return sorted(items, key=lambda kv: -kv[1]["share"])


def _ms(v: float | str) -> str:
    return v if isinstance(v, str) else f"{v:.1f} ms"


if __name__ == "__main__":
    main()
