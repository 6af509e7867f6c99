"""Speculative decoding on the GPU (issue 14).

    python3 benchmarks/spec_bench.py --out $OUT/spec.json [--sections curve,pd,decode]
    python3 benchmarks/spec_bench.py --out /tmp/spec.json --device cpu    (smoke: tiny preset)

curve  glm5-d24-e32 (drawn on the device, --load-format dummy), where one MTP draft step
       is a small share of a target step as in the real model. One model with its MTP
       layer is built once and shared by three engines: no speculation, MTP k=1 and MTP
       k=3 (synthetic rejection at acceptance 0.5 / 0.7 / 0.9: random weights accept
       almost nothing). Batch 1 and 32 at a 16K context: the requests share a 16K-token
       prefix (prefilled once, then a prefix-cache hit) plus a distinct 32-token tail,
       then decode 96 tokens each. Reported: TPOT (mean over requests of (last token -
       first token) / (tokens - 1)), decode throughput, steps, the share of steps on CUDA
       graphs, draft-graph replays, and the mean acceptance length the engine counted.
       Caveat: requests reading one shared prefix may hit L2 on KV reads; at 16K the KV
       is about 6% of a step's bytes on this preset (weights dominate).
decode glm5-m12-e64 (dummy; real GLM-5 per-layer dims) decoding at a 16K context (issue 27):
       TPOT by streams (--streams, default 1,64,128,192,224,256) for no speculation, MTP k=1 and
       k=3 verifying every draft (draft_policy fixed), and MTP k=3 with the adaptive draft count,
       at synthetic acceptance 0.5 / 0.7 / 0.9, one engine per config on one drawn model (the
       adaptive one forgets its measured acceptance at each new rate and re-measures it on a short
       run first; its rows list the steps by drafts chosen). Every request shares one 16K prefix
       (prefilled once; the prefix-cache hits are counted) plus a distinct 32-token tail, so the
       timed part is steady decode: from the step at which every stream has its first token to the
       last token; each batch size runs once untimed first (one-time costs stay out). Per point:
       the steady TPOT (the steps that ran every stream over the tokens a stream gained in them: a
       request's own TPOT also counts the steps that prefilled later streams; the ratios to no
       speculation use it), TPOT, the mean step time, the batch reached (streams decoding in every
       timed step), the share of steps replayed from CUDA graphs, draft-graph replays, acceptance
       length, and the step's byte roofline (pdserve.profiling.decode_roofline: weights, the
       experts B * (1 + k) tokens reach under uniform routing, latents once per query row, indexer
       keys once per request; plus k MTP draft steps, each reading the MTP layer's weights (its
       experts as reached), the LM head, its latents and indexer keys) over the copy bandwidth
       measured in the same call, the roofline's TPOT (step roofline / tokens a request gains per
       step) and TPOT against no speculation; and a mixed roofline that also holds when the rows
       are many (per part, the larger of its bytes over the bandwidth and its FLOPs over the bf16
       matmul rate of the call: pdserve.profiling.prefill_flops step_flops; drafts by bytes).
       ``--profile-streams N,..``: one steady step at those stream counts (no speculation, rate
       0.7, and the adaptive engine at 0.5) runs under the profiler: kernel time by category and
       the longest kernels. Caveat (as in curve): a shared prefix's KV may be served from L2.
pd     glm5-s4-e16 (dummy) 1P1D in one process over tcp on loopback: prefill MTP k=1,
       decode MTP k=3, 32 requests of 1K prompts arriving 4 at a time while earlier ones
       decode; the decode instance's steps by path, with speculative padding on and off.

Every number goes to the JSON file; a table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.engine_core import EngineCore  # noqa: E402
from pdserve.frontend.processor import InputProcessor  # noqa: E402
from pdserve.frontend.tokenizer import Tokenizer  # noqa: E402
from pdserve.models import loader  # noqa: E402
from pdserve.profiling.decode_roofline import DecodeByteModel, layer_index  # noqa: E402
from pdserve.profiling.kernel_compiles import compiled_variants, new_variants  # noqa: E402
from pdserve.profiling.prefill_flops import PrefillFlopModel  # noqa: E402
from pdserve.profiling.step_profile import profile_step  # noqa: E402
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

ARCH = "GlmMoeDsaForCausalLM"
CTX = 16384  # --ctx
TAIL = 32
OUT_TOKENS = 96
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (tiny preset, short ctx)
DTYPE = "bfloat16"  # float32 on the CPU
KV_BYTES = 6 << 30  # each engine's KV cache (64 MiB on the CPU)
CPU_PRESET = "tiny"
DECODE_STREAMS = (1, 64, 128, 192, 224, 256)  # 224: issue 27 asks 200+ streams within 20 ms
RATES = (0.5, 0.7, 0.9)


def _prompt(n: int, seed: int, vocab: int = 150000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- curve
def _decode(llm: LLM, tag: str, batch: int, prefix: list[int], out_tokens: int = 0,
            profile: bool = False) -> dict[str, Any]:  # fmt: skip
    """One point: ``batch`` streams decode ``out_tokens`` (default ``OUT_TOKENS``) each;
    ``profile``: one steady step (every stream decoding) runs under the profiler."""
    eng = llm.engine
    vocab = eng.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=out_tokens or OUT_TOKENS, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(
            llm.processor.make_request(rid, prefix + _prompt(TAIL, 1000 + i, vocab), sp)
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    before = eng.stats()
    hosts: list[float] = []  # those steps' host time not spent waiting for the device
    dg = eng.runner.draft_graphs
    replays0 = dg.replays if dg is not None else 0
    decode_start = None
    steps0 = None
    compiled0: dict[str, set] = {}
    live: list[int] = []  # streams of this batch scheduled in each timed step
    full: list[float] = []  # durations of the timed steps that ran every stream
    full_tokens = 0  # the tokens the batch's streams gained in those steps
    prof: dict[str, Any] | None = None
    while len(last) < batch:
        if decode_start is not None:
            live.append(sum(r.request_id in first for r in eng.scheduler.running))
        steady = len(live) > 1 and live[-1] == batch  # not the step that began timing
        t_step = time.perf_counter()
        if profile and prof is None and steady:
            got: list[Any] = []
            prof = profile_step(lambda got=got: got.append(eng.step()), None,
                                eng.runner.device).table(40)  # fmt: skip
            # the draft count scheduled in the profiled call (adaptive: which j it shows)
            prof["num_drafts_scheduled"] = eng.stats().spec_last_num_drafts
            outs, steady = got[0], False  # (the profiler's time is not a step's)
        else:
            waited = -eng.pipeline.waited_s
            outs = eng.step()
            waited += eng.pipeline.waited_s  # this step's wait for the device
        now = time.perf_counter()
        if steady:
            full.append(now - t_step)
            hosts.append(now - t_step - waited)
            full_tokens += sum(len(o.new_token_ids) for o in outs if o.request_id in count)
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finish_reason is not None:
                last[o.request_id] = now
        if decode_start is None and len(first) == batch:
            decode_start, steps0 = now, eng.stats()
            compiled0 = compiled_variants()
    after = eng.stats()
    compiles = new_variants(compiled0, compiled_variants())
    assert decode_start is not None and steps0 is not None
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in ids]
    verifies = after.spec_num_drafts - steps0.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - steps0.spec_num_accepted_tokens
    paths = {
        k: v - steps0.step_paths.get(k, 0)
        for k, v in after.step_paths.items()
        if v - steps0.step_paths.get(k, 0)
    }
    decode_steps = sum(paths.values())
    # steady TPOT: the steps that ran every stream over the tokens a stream gained in them
    # (a request's own TPOT also counts the steps that prefilled streams after its start)
    steady_tpot = sum(full) / (full_tokens / batch) * 1e3 if full and full_tokens else None
    return {
        "batch": batch,
        "tpot_ms": statistics.mean(tpot) * 1e3,
        "steady_tpot_ms": steady_tpot,
        "steady_steps": len(full),
        "profile": prof,
        "decode_tok_s": sum(count.values()) / (max(last.values()) - decode_start),
        "decode_steps": decode_steps,
        "decode_s": max(last.values()) - decode_start,
        "live_min": min(live, default=0),
        "live_mean": statistics.mean(live) if live else 0.0,
        "full_step_ms": statistics.median(full) * 1e3 if full else None,
        # the host's time a full step that it did not spend waiting for the device: near
        # the step's time, the host sets the pace (a bubble on the device)
        "full_step_host_ms": statistics.median(hosts) * 1e3 if hosts else None,
        "graph_share": paths.get("graph", 0) / max(decode_steps, 1),
        "paths": paths,
        "steps_by_num_drafts": [
            n - (steps0.spec_steps_by_num_drafts[i] if i < len(steps0.spec_steps_by_num_drafts) else 0)
            for i, n in enumerate(after.spec_steps_by_num_drafts)
        ],
        "draft_graph_replays": (dg.replays - replays0) if dg is not None else 0,
        "mean_accept_len": 1 + accepted / verifies if verifies else None,
        "prefix_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        # Triton variants compiled while timed (each a stall of 0.1-0.5 s): must be none
        "kernel_compiles": compiles,
    }


def bench_curve(workdir: Path, preset: str, save: Any) -> dict[str, Any]:
    path = _config_dir(workdir, preset)
    t0 = time.perf_counter()
    model, cfg = loader.load_model(path, DTYPE, DEVICE, load_format="dummy", seed=0, with_mtp=True)
    res: dict[str, Any] = {"preset": preset, "draw_s": time.perf_counter() - t0, "runs": []}
    real_load = loader.load_model
    loader.load_model = lambda *a, **k: (model, cfg)  # one model for every engine
    prefix = _prompt(CTX, 7, cfg.vocab_size)
    try:
        for k in (0, 1, 3):
            spec = None
            if k:
                spec = {
                    "method": "mtp",
                    "num_speculative_tokens": k,
                    "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rate": 0.5,
                    "draft_policy": "fixed",
                }
            t0 = time.perf_counter()
            llm = _llm(path, spec, 32)
            start = time.perf_counter() - t0
            t0 = time.perf_counter()
            _decode(llm, "warm", 1, prefix)  # the shared prefix, prefilled once
            prefill_s = time.perf_counter() - t0
            runner = llm.engine.runner
            for rate in (0.5, 0.7, 0.9) if k else (None,):
                if rate is not None:
                    runner.synthetic_rate = rate
                for batch in (1, 32) if DEVICE == "cuda" else (1, 3):
                    r = _decode(llm, f"k{k}-{rate}", batch, prefix)
                    r.update(k=k, rate=rate, startup_s=start, warm_prefill_s=prefill_s)
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
                    save(res)  # a timeout keeps what was measured
            del llm, runner
            _free()
    finally:
        loader.load_model = real_load
    return res


# -------------------------------------------------------------------------- decode
def _config_dir(workdir: Path, preset: str) -> Path:
    """The preset's config (and tokenizer): weights are drawn at load (``dummy``)."""
    path = workdir / preset
    if not (path / "config.json").is_file():
        make_checkpoint(ARCH, preset, path, dtype=DTYPE, device="cpu", config_only=True)
    return path


def _llm(path: Path, spec: dict[str, Any] | None, max_seqs: int) -> LLM:
    sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 192, 224, 256, max_seqs})
    return LLM(
        str(path),
        device=DEVICE,
        dtype=DTYPE,
        max_model_len=CTX + 256,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=KV_BYTES,
        speculative_config=spec,
        compilation_config={"cudagraph_capture_sizes": [b for b in sizes if b <= max_seqs]},
    )


def _synthetic(k: int, rate: float, policy: str = "fixed") -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": rate, "draft_policy": policy}  # fmt: skip


# (k, draft policy) of the decode section's engines: none, MTP k=1 and k=3 verifying
# every draft, and k=3 with the adaptive draft count
DECODE_CONFIGS = ((0, None), (1, "fixed"), (3, "fixed"), (3, "adaptive"))


@dataclass(frozen=True)
class DraftBytes:
    """What one MTP draft step of B requests reads: the MTP layer's weights but its routed
    experts, the experts B tokens reach, the LM head, and the layer's latents and indexer
    keys (its own indexer scores every draft)."""

    dense: int
    expert: int  # one routed expert
    head: int

    @classmethod
    def from_model(cls, model: Any) -> DraftBytes:
        from pdserve.layers.moe import RoutedExperts

        n = int(model.config.num_hidden_layers)
        dense = expert = 0
        experts = {f"{name}.{p}" for name, m in model.named_modules()
                   if isinstance(m, RoutedExperts) for p, _ in m.named_parameters()}  # fmt: skip
        for name, m in model.named_modules():
            if isinstance(m, RoutedExperts) and (layer_index(name) or 0) >= n:
                expert = sum(t.numel() * t.element_size() for t in m.parameters()) // max(
                    1, m.num_local_experts)
        for name, t in model.named_parameters():
            if (layer_index(name) or 0) >= n and name not in experts:
                dense += t.numel() * t.element_size()
        head = model.lm_head.weight
        return cls(dense, expert, head.numel() * head.element_size())

    def step(self, bm: DecodeByteModel, batch: int, ctx: float) -> float:
        lat = bm.latent_row_bytes[0] if bm.latent_row_bytes else 0
        key = bm.index_key_bytes[0] if bm.index_key_bytes else 0
        topk = bm.index_topk
        attended = ctx if topk is None else min(ctx, topk)
        scored = ctx if topk is not None and ctx > topk else 0
        return (self.dense + self.head + bm.expected_active_experts(batch) * self.expert
                + batch * (attended * lat + scored * key))  # fmt: skip


def config_name(k: int, policy: str | None) -> str:
    """A decode engine's name in the table and in ``--configs``: 0, 1, 3, 3a."""
    return f"{k}{'a' if policy == 'adaptive' else ''}"


def bench_decode(workdir: Path, preset: str, streams: list[int], bw: float | None,
                 save: Any, profile_streams: tuple[int, ...] = (),
                 peak: float | None = None,
                 configs: tuple[tuple[int, str | None], ...] = DECODE_CONFIGS,
                 rates: tuple[float, ...] = RATES) -> dict[str, Any]:  # fmt: skip
    path = _config_dir(workdir, preset)
    t0 = time.perf_counter()
    model, cfg = loader.load_model(path, DTYPE, DEVICE, load_format="dummy", seed=0, with_mtp=True)
    res: dict[str, Any] = {"preset": preset, "ctx": CTX, "streams": streams,
                           "draw_s": time.perf_counter() - t0, "runs": []}  # fmt: skip
    draft = DraftBytes.from_model(model)
    fm = PrefillFlopModel.from_model(model)
    real_load = loader.load_model
    loader.load_model = lambda *a, **k: (model, cfg)  # one model for every engine
    prefix = _prompt(CTX, 7, cfg.vocab_size)
    base: dict[int, float] = {}
    base_roof: dict[int, float | None] = {}  # no speculation's mixed roofline step, per batch
    try:
        for k, policy in configs:
            t0 = time.perf_counter()
            llm = _llm(path, _synthetic(k, rates[0], policy or "fixed") if k else None,
                       max(streams))  # fmt: skip
            start = time.perf_counter() - t0
            runner = llm.engine.runner
            bm = DecodeByteModel.from_model(runner.model, runner.kv_cache_config)
            _decode(llm, "warm", 1, prefix)  # the shared prefix, prefilled once
            for b in streams:  # each batch once untimed: one-time costs out of the timing
                _decode(llm, f"w{b}", b, prefix, out_tokens=8)
            adaptive = llm.engine.scheduler.spec.policy
            for rate in rates if k else (None,):
                if rate is not None:
                    runner.synthetic_rate = rate
                    if adaptive is not None:  # measure this rate afresh, on a mid batch
                        adaptive.reset_acceptance()
                        _decode(llm, f"a{rate}", max(1, max(streams) // 4), prefix, out_tokens=16)
                for b in streams:
                    # (adaptive at 0.5: its j=0 steps against plain decode; run 67 fixed
                    # their sync)
                    prof = b in profile_streams and (
                        rate in (None, 0.7) or (policy == "adaptive" and rate == 0.5))
                    r = _decode(llm, f"d{k}{policy}-{rate}", b, prefix, profile=prof)
                    ctx = CTX + TAIL + OUT_TOKENS / 2
                    # the roofline of the draft count the steps ran (adaptive: the most used)
                    j = k if not r["steps_by_num_drafts"] else max(
                        range(len(r["steps_by_num_drafts"])),
                        key=lambda i: r["steps_by_num_drafts"][i])  # fmt: skip
                    parts = bm.step_bytes([ctx] * b, rows_per_request=1 + j)
                    drafting = j * draft.step(bm, b, ctx) if j else 0
                    step_bytes = parts["total"] + drafting
                    gain = sum((rate or 0.0) ** i for i in range(j + 1))  # tokens a step
                    if adaptive is not None:  # the costs it chose by (ms, j = 0..k): graph
                        shape = adaptive.shape(b, int(ctx))  # timings, then what it used
                        r["policy_costs"] = None if shape is None else {
                            "graph": [1e3 * c for c in adaptive.costs[shape]],
                            "used": [1e3 * c for c in adaptive.step_costs(b, int(ctx)) or []],
                            "acceptance": adaptive.acceptance()}  # fmt: skip
                    r.update(k=k, policy=policy, rate=rate, startup_s=start, main_num_drafts=j,
                             step_ms=r["decode_s"] / max(r["decode_steps"], 1) * 1e3,
                             step_bytes=step_bytes, expected_tokens_per_step=gain)  # fmt: skip
                    if bw:  # against the steps that ran the whole batch
                        r["roofline_step_ms"] = step_bytes / bw * 1e3
                        r["roofline_tpot_ms"] = r["roofline_step_ms"] / gain
                        if r["full_step_ms"]:
                            r["step_x_roofline"] = r["full_step_ms"] / r["roofline_step_ms"]
                    if bw and peak:  # per part the larger of its bytes' and its FLOPs' time
                        fl = fm.step_flops([ctx] * b, rows_per_request=1 + j)
                        r["step_tflop"] = fl["total"] / 1e12
                        r["roofline_mixed_step_ms"] = 1e3 * (
                            max(parts["weights"] / bw, (fl["dense_gemm"] + fl["router"]) / peak)
                            + max(parts["experts"] / bw, fl["moe_experts"] / peak)
                            + max(parts["latents"] / bw, fl["mla_attention"] / peak)
                            + max(parts["index_keys"] / bw, fl["indexer_score"] / peak)
                            + (parts["other_kv"] + drafting) / bw)  # fmt: skip
                        if r["full_step_ms"]:
                            r["step_x_mixed"] = r["full_step_ms"] / r["roofline_mixed_step_ms"]
                    tpot = r["steady_tpot_ms"] or r["tpot_ms"]  # (no steady step: its own)
                    mixed = r.get("roofline_mixed_step_ms")  # its roofline TPOT: per token
                    if k == 0:
                        base[b] = tpot
                        base_roof[b] = mixed
                    r["tpot_vs_none"] = tpot / base[b] if b in base else None
                    # the best "vs none" this point's roofline allows: its mixed roofline
                    # TPOT over no speculation's (a bar below it needs fewer bytes or FLOPs)
                    r["bound_vs_none"] = (mixed / gain / base_roof[b]
                                          if mixed and base_roof.get(b) else None)  # fmt: skip
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
                    save(res)
            del llm, runner
            _free()
    finally:
        loader.load_model = real_load
    return res


# ------------------------------------------------------------------------------ pd
def _engine(path: Path, role: str, spec: dict[str, Any]) -> EngineCore:
    cfg = EngineConfig.from_kwargs(
        model=str(path),
        device=DEVICE,
        dtype=DTYPE,
        load_format="dummy",
        max_model_len=min(4096, CTX + 256),
        max_num_seqs=32,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=KV_BYTES,
        speculative_config=spec,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
        kv_transfer_config={
            "kv_connector": "PdConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": "tcp"},
        },
    )
    return EngineCore(cfg)


def bench_pd(workdir: Path, preset: str) -> list[dict[str, Any]]:
    os.environ.setdefault("PDSERVE_PD_SECRET", os.urandom(32).hex())
    path = _config_dir(workdir, preset)
    out = []
    for pad in (True, False):
        p = _engine(path, "kv_producer", {"method": "mtp", "num_speculative_tokens": 1})
        d_spec = {"method": "mtp", "num_speculative_tokens": 3, "pad_first_decode_step": pad}
        d = _engine(path, "kv_consumer", d_spec)
        tok = Tokenizer.from_pretrained(path)
        pp = InputProcessor(tok, p.max_model_len, p.vocab_size)
        dp = InputProcessor(tok, d.max_model_len, d.vocab_size)
        psp = SamplingParams(temperature=0.0, max_tokens=1)
        dsp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        remote = {"do_remote_decode": True, "do_remote_prefill": False}
        n = 32 if DEVICE == "cuda" else 8
        prompts = {f"pd{pad}-{i}": _prompt(min(1024, CTX), 50 + i, p.vocab_size) for i in range(n)}
        pending = list(prompts)
        done: set[str] = set()
        before = d.stats()
        it = 0
        deadline = time.monotonic() + 240
        while len(done) < len(prompts):
            assert time.monotonic() < deadline, "1P1D run timed out"
            if pending and it % 3 == 0:
                for rid in pending[:4]:
                    p.add_request(pp.make_request(rid, prompts[rid], psp, remote))
                pending = pending[4:]
            for o in p.step():
                if o.finish_reason is not None and o.kv_transfer_params is not None:
                    rid = o.request_id
                    d.add_request(dp.make_request(rid, prompts[rid], dsp, o.kv_transfer_params))
            for o in d.step():
                if o.finish_reason is not None:
                    done.add(o.request_id)
            it += 1
        after = d.stats()
        paths = {
            k: v - before.step_paths.get(k, 0)
            for k, v in after.step_paths.items()
            if v - before.step_paths.get(k, 0)
        }
        total = sum(paths.values())
        r = {
            "pad": pad,
            "decode_steps": total,
            "graph_share": paths.get("graph", 0) / max(total, 1),
            "paths": paths,
            "padded_first_steps": after.spec_num_padded_steps - before.spec_num_padded_steps,
            "kv_transfer_failures": after.kv_transfer_failures,
        }
        out.append(r)
        print(json.dumps(r), flush=True)
        p.shutdown()
        d.shutdown()
        del p, d
        _free()
    return out


def main(argv: list[str] | None = None) -> None:
    global CTX, DEVICE, DTYPE, KV_BYTES, OUT_TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="curve,pd", help="curve,pd,decode")
    ap.add_argument("--curve-preset", default="glm5-d24-e32")
    ap.add_argument("--pd-preset", default="glm5-s4-e16")
    ap.add_argument("--decode-preset", default="glm5-m12-e64")
    ap.add_argument("--streams", default=",".join(map(str, DECODE_STREAMS)),
                    help="decode section: concurrent streams per point")  # fmt: skip
    ap.add_argument("--configs", default=",".join(config_name(*c) for c in DECODE_CONFIGS),
                    help="decode section: engines (0 none, 1 / 3 MTP k, 3a adaptive)")
    ap.add_argument("--rates", default=",".join(map(str, RATES)),
                    help="decode section: synthetic acceptance rates of the MTP engines")
    ap.add_argument("--out-tokens", type=int, default=OUT_TOKENS)
    ap.add_argument("--profile-streams", default="",
                    help="decode section: profile one steady step at these stream counts "
                         "(no speculation, rate 0.7, adaptive at 0.5)")  # fmt: skip
    ap.add_argument("--workdir", default="/tmp/pdserve-spec")
    ap.add_argument("--ctx", type=int, default=None, help=f"context (default {CTX}; CPU 40)")
    ap.add_argument("--device", default=DEVICE, choices=("cuda", "cpu"))
    a = ap.parse_args(argv)
    DEVICE = a.device
    cpu = DEVICE == "cpu"
    CTX = a.ctx or (40 if cpu else CTX)
    OUT_TOKENS = a.out_tokens if not cpu or a.out_tokens != OUT_TOKENS else 8
    if cpu:  # a smoke run of every section: the tiny preset in float32, small buffers
        DTYPE, KV_BYTES = "float32", 64 << 20
        a.curve_preset = a.pd_preset = a.decode_preset = CPU_PRESET
    streams = [int(x) for x in a.streams.split(",")] if not cpu else [1, 3]
    profile = tuple(int(x) for x in a.profile_streams.split(",") if x)
    by_name = {config_name(*c): c for c in DECODE_CONFIGS}
    bad = [c for c in a.configs.split(",") if c not in by_name]
    if bad:
        sys.exit(f"unknown --configs {bad}: choose from {', '.join(by_name)}")
    configs = tuple(by_name[c] for c in a.configs.split(","))
    rates = tuple(float(x) for x in a.rates.split(","))
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "commit": os.environ.get("PDSERVE_COMMIT", "unknown"),
    }
    sections = a.sections.split(",")
    unknown = set(sections) - {"curve", "pd", "decode"}
    if unknown:
        sys.exit(f"unknown section(s) {sorted(unknown)}: choose from curve, pd, decode")
    if "decode" in sections:  # (the CPU's, in the smoke run: the roofline code runs too)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_suite import CPU_SIZES, measure_limits

        res["limits"] = measure_limits("cpu", CPU_SIZES) if cpu else measure_limits()
    if "pd" in sections:
        res["pd"] = bench_pd(work, a.pd_preset)
        Path(a.out).write_text(json.dumps(res, indent=1))
    for name, run in (
        ("curve", lambda save: bench_curve(work, a.curve_preset, save)),
        ("decode", lambda save: bench_decode(work, a.decode_preset, streams,
                                             res.get("limits", {}).get("copy_bandwidth_Bps"),
                                             save, profile,
                                             res.get("limits", {}).get("bf16_matmul_flops"),
                                             configs, rates)),
    ):  # fmt: skip
        if name not in sections:
            continue

        def save(part: dict[str, Any], name: str = name) -> None:
            Path(a.out).write_text(json.dumps({**res, name: part}, indent=1))

        res[name] = run(save)
        Path(a.out).write_text(json.dumps(res, indent=1))
    _table(res)


def _table(res: dict[str, Any]) -> None:
    if "curve" in res:
        c = res["curve"]
        print(f"\n{c['preset']}: TPOT and decode throughput at a {CTX}-token context")
        print("  k  rate  batch  TPOT ms  tok/s    steps  graph%  draft-graphs  accept-len")
        base = {r["batch"]: r for r in c["runs"] if r["k"] == 0}
        for r in c["runs"]:
            acc = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-"
            speed = base[r["batch"]]["tpot_ms"] / r["tpot_ms"]
            print(
                f"  {r['k']}  {r['rate'] or '-':>4}  {r['batch']:>5}  {r['tpot_ms']:7.2f}"
                f"  {r['decode_tok_s']:7.0f}  {r['decode_steps']:5d}  {100 * r['graph_share']:5.1f}"
                f"  {r['draft_graph_replays']:12d}  {acc:>10}   x{speed:.2f} vs k=0"
            )
    if "decode" in res:
        d = res["decode"]
        print(f"\n{d['preset']}: decode at a {d['ctx']}-token context (shared prefix), TPOT by streams")
        print("  (steady TPOT: the steps that ran every stream over the tokens a stream gained"
              " in them; vs none: steady TPOT over no speculation's)")
        print("  (roof step: bytes / copy bandwidth; mixed: per part the larger of bytes / bandwidth"
              " and FLOPs / bf16 matmul rate)")
        print("  (host: a full-batch step's host time not spent waiting for the device; near the"
              " step's time, the host sets the pace)")
        print("  (bound: the best vs none the point's mixed roofline allows, its roofline TPOT"
              " over no speculation's)")
        print("  k  rate  streams  steady  TPOT ms  vs none  bound  step ms  full-batch step  host"
              "  roof step  x roof  mixed  x mixed  roof TPOT  live min  graph%  accept-len")  # fmt: skip
        for r in d["runs"]:
            acc = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-"
            if r["policy"] == "adaptive":
                acc += f"  j: {r['steps_by_num_drafts']}"
                pc = r.get("policy_costs")
                if pc:  # the step costs it weighed, ms for j = 0..k: graph -> used
                    acc += "  ms: " + " ".join(
                        f"{g:.1f}>{u:.1f}" for g, u in zip(pc["graph"], pc["used"], strict=True))
            vs = f"{r['tpot_vs_none']:.2f}" if r["tpot_vs_none"] else "-"
            bound = f"{r['bound_vs_none']:.2f}" if r.get("bound_vs_none") else "-"
            roof = r.get("roofline_step_ms", float("nan"))
            fs = f"{r['full_step_ms']:.2f}" if r["full_step_ms"] else "-"
            host = f"{r['full_step_host_ms']:.2f}" if r["full_step_host_ms"] else "-"
            tag = f"{r['k']}{'a' if r['policy'] == 'adaptive' else ' '}"
            st = f"{r['steady_tpot_ms']:.2f}" if r["steady_tpot_ms"] else "-"
            print(f"  {tag} {r['rate'] or '-':>4}  {r['batch']:>7}  {st:>6}  {r['tpot_ms']:7.2f}"
                  f"  {vs:>7}  {bound:>5}  {r['step_ms']:7.2f}  {fs:>15}  {host:>5}  {roof:9.2f}"
                  f"  {r.get('step_x_roofline', 0):6.2f}"
                  f"  {r.get('roofline_mixed_step_ms', float('nan')):5.2f}"
                  f"  {r.get('step_x_mixed', 0):7.2f}"
                  f"  {r.get('roofline_tpot_ms', float('nan')):9.2f}  {r['live_min']:8d}"
                  f"  {100 * r['graph_share']:5.1f}  {acc:>10}")  # fmt: skip
        for r in d["runs"]:
            if r.get("kernel_compiles"):  # a stall inside the timed steps: the point is off
                print(f"  ! k={r['k']}{r['policy'] or ''} rate {r['rate']} x{r['batch']} compiled"
                      f" {sorted(r['kernel_compiles'])} while timed")  # fmt: skip
        for r in d["runs"]:
            p = r.get("profile")
            if not p:
                continue
            cats = "  ".join(f"{c} {v['ms']:.2f}" for c, v in p["categories"].items() if v["ms"])
            print(f"  profile k={r['k']}{r['policy'] or ''} rate {r['rate']} x{r['batch']}: "
                  f"wall {p['wall_ms']:.2f} ms, span {p['span_ms']:.2f}, {p['kernels']} kernels,"
                  f" idle {p['idle_gap']['ms']:.2f}: {cats}")  # fmt: skip
            for t in p["top"][:5]:
                print(f"      {t['ms']:7.3f} ms x{t['count']:<4} {t['name'][:90]}")
    for r in res.get("pd", []):
        print(
            f"1P1D decode (k=3, padding {'on' if r['pad'] else 'off'}): "
            f"{100 * r['graph_share']:.1f}% of {r['decode_steps']} steps on graphs, "
            f"padded first steps {r['padded_first_steps']}, paths {r['paths']}"
        )


if __name__ == "__main__":
    main()
