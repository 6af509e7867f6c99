"""Speculative decoding on the GPU (issue 14).

    python3 benchmarks/spec_bench.py --out $OUT/spec.json [--sections curve,pd]

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
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

ARCH = "GlmMoeDsaForCausalLM"
CTX = 16384  # --ctx
TAIL = 32
OUT_TOKENS = 96
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (tiny preset, short ctx)


def _prompt(n: int, seed: int, vocab: int = 150000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- curve
def _decode(llm: LLM, tag: str, batch: int, prefix: list[int]) -> dict[str, Any]:
    eng = llm.engine
    vocab = eng.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        eng.add_request(
            llm.processor.make_request(rid, prefix + _prompt(TAIL, 1000 + i, vocab), sp)
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    before = eng.stats()
    dg = eng.runner.draft_graphs
    replays0 = dg.replays if dg is not None else 0
    decode_start = None
    steps0 = None
    while len(last) < batch:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finish_reason is not None:
                last[o.request_id] = now
        if decode_start is None and len(first) == batch:
            decode_start, steps0 = now, eng.stats()
    after = eng.stats()
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
    return {
        "batch": batch,
        "tpot_ms": statistics.mean(tpot) * 1e3,
        "decode_tok_s": sum(count.values()) / (max(last.values()) - decode_start),
        "decode_steps": decode_steps,
        "graph_share": paths.get("graph", 0) / max(decode_steps, 1),
        "paths": paths,
        "draft_graph_replays": (dg.replays - replays0) if dg is not None else 0,
        "mean_accept_len": 1 + accepted / verifies if verifies else None,
        "prefix_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
    }


def bench_curve(workdir: Path, preset: str, save: Any) -> dict[str, Any]:
    path = workdir / preset
    if not (path / "config.json").is_file():
        make_checkpoint(ARCH, preset, path, dtype="bfloat16", device=DEVICE, config_only=True)
    t0 = time.perf_counter()
    model, cfg = loader.load_model(
        path, "bfloat16", DEVICE, load_format="dummy", seed=0, with_mtp=True
    )
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
                }
            t0 = time.perf_counter()
            llm = LLM(
                str(path),
                device=DEVICE,
                dtype="bfloat16",
                max_model_len=CTX + 256,
                max_num_seqs=32,
                max_num_batched_tokens=2048,
                kv_cache_memory_bytes=6 << 30,
                speculative_config=spec,
                compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
            )
            start = time.perf_counter() - t0
            t0 = time.perf_counter()
            _decode(llm, "warm", 1, prefix)  # the shared prefix, prefilled once
            prefill_s = time.perf_counter() - t0
            runner = llm.engine.runner
            for rate in (0.5, 0.7, 0.9) if k else (None,):
                if rate is not None:
                    runner.synthetic_rate = rate
                for batch in (1, 32):
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


# ------------------------------------------------------------------------------ pd
def _engine(path: Path, role: str, spec: dict[str, Any]) -> EngineCore:
    cfg = EngineConfig.from_kwargs(
        model=str(path),
        device=DEVICE,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=min(4096, CTX + 256),
        max_num_seqs=32,
        max_num_batched_tokens=4096,
        kv_cache_memory_bytes=8 << 30,
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
    path = workdir / preset
    if not (path / "config.json").is_file():
        make_checkpoint(ARCH, preset, path, dtype="bfloat16", device=DEVICE, config_only=True)
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
        prompts = {f"pd{pad}-{i}": _prompt(min(1024, CTX), 50 + i, p.vocab_size) for i in range(32)}
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


def main() -> None:
    global CTX, DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="curve,pd")
    ap.add_argument("--curve-preset", default="glm5-d24-e32")
    ap.add_argument("--pd-preset", default="glm5-s4-e16")
    ap.add_argument("--workdir", default="/tmp/pdserve-spec")
    ap.add_argument("--ctx", type=int, default=CTX)
    ap.add_argument("--device", default=DEVICE)
    a = ap.parse_args()
    CTX, DEVICE = a.ctx, a.device
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "commit": os.environ.get("PDSERVE_COMMIT", "unknown"),
    }
    sections = a.sections.split(",")
    if "pd" in sections:
        res["pd"] = bench_pd(work, a.pd_preset)
        Path(a.out).write_text(json.dumps(res, indent=1))
    if "curve" in sections:

        def save(curve: dict[str, Any]) -> None:
            Path(a.out).write_text(json.dumps({**res, "curve": curve}, indent=1))

        res["curve"] = bench_curve(work, a.curve_preset, save)
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
    for r in res.get("pd", []):
        print(
            f"1P1D decode (k=3, padding {'on' if r['pad'] else 'off'}): "
            f"{100 * r['graph_share']:.1f}% of {r['decode_steps']} steps on graphs, "
            f"padded first steps {r['padded_first_steps']}, paths {r['paths']}"
        )


if __name__ == "__main__":
    main()
