"""The GLM-5 family on the GPU (issue 13): correctness at real shapes, and reference-path
speed next to transformers and the roofline.

    python3 benchmarks/glm5_bench.py --out $OUT/glm5.json [--sections accuracy,speed]
                                     [--presets glm5-s4-e16,glm5-m12-e64]

accuracy  glm5-s4-e16 (written on the GPU): pdserve bf16 against transformers fp32 on one
          2560-token prompt (longer than index_topk 2048, so DSA decides), with
          transformers' own bf16 error as the yardstick: mean KL(fp32 || x) over positions,
          argmax agreement, and the indexer's top-2048 overlap per layer (rows >= 2048)
speed     per preset: decode step at batch 1 and 32 with 1K and 16K contexts (graphs on;
          ``--long``: also batch 8 with 128K), and one 16K prompt's prefill; the roofline of a decode step is
          (non-expert weights + active experts + LM head + latents of the selected keys
          + indexer keys of the whole context) / the copy bandwidth measured now;
          transformers' GlmMoeDsaForCausalLM (bf16, eager) on the same preset where it fits
          glm5-m12-e64 is drawn on the device (--load-format dummy; 53 GB does not fit
          the disk); transformers' copy gets its own random init

Every number goes to the JSON file; a table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import measure_limits  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.layers.attention import CommonAttentionMetadata  # noqa: E402
from pdserve.layers.attention.dsa import Indexer  # noqa: E402
from pdserve.testing.checkpoint import make_checkpoint  # noqa: E402

ARCH = "GlmMoeDsaForCausalLM"
TOPK = 2048


def _free() -> None:
    gc.collect()
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
def _roofline_bytes(cfg: dict, batch: int, ctx: int, expert_bytes: int, other_bytes: int) -> int:
    """Bytes a decode step must read: every non-expert weight once, the experts the
    batch's routing activates (expected count for random routing), the latents of the
    selected keys per query and the indexer keys of each request's whole context."""
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_expert = expert_bytes / (moe_layers * e)
    active = e * (1 - (1 - k / e) ** batch)
    latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    index_key = cfg["index_head_dim"] * 2
    layers = cfg["num_hidden_layers"]
    kv = batch * layers * (min(ctx, TOPK) * latent + ctx * index_key)
    return int(other_bytes + moe_layers * active * per_expert + kv)


def _split_weights(llm: LLM) -> tuple[int, int]:
    expert = other = 0
    for name, p in llm.engine.runner.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes
        elif "embed_tokens" not in name:
            other += nbytes
    return expert, other


def _decode(llm: LLM, batch: int, ctx: int, steps: int = 12) -> dict:
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request(llm.processor.make_request(f"d{batch}-{ctx}-{i}", _prompt(ctx, 10 + i), sp))
    t0 = time.perf_counter()
    while eng.scheduler.waiting or any(
        not r.output_token_ids for r in eng.scheduler.requests.values()
    ):
        eng.step()
    prefill_s = time.perf_counter() - t0
    for _ in range(2):
        eng.step()
    torch.cuda.synchronize()
    times = []
    paths = dict(eng.stats().step_paths)
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    after = eng.stats().step_paths
    eng.abort_requests(list(eng.scheduler.requests))
    for _ in range(3):
        eng.step()
    return {
        "batch": batch,
        "ctx": ctx,
        "step_ms": statistics.median(times) * 1e3,
        "prefill_s_all": prefill_s,
        "graph_steps": after.get("graph", 0) - paths.get("graph", 0),
    }


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


LONG_CTX = 131072


def bench_speed(
    preset: str, workdir: Path, limits: dict, hf_peer: bool, long: bool = False
) -> dict:
    path = workdir / preset
    dummy = preset != "glm5-s4-e16"
    if not (path / "config.json").is_file():
        make_checkpoint(ARCH, preset, path, dtype="bfloat16", device="cuda", config_only=dummy)
    cfg = json.loads((path / "config.json").read_text())
    t0 = time.perf_counter()
    llm = LLM(
        str(path),
        dtype="bfloat16",
        load_format="dummy" if dummy else "auto",
        max_model_len=(LONG_CTX if long else 16384) + 256,
        max_num_seqs=32,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
    )
    res: dict = {"preset": preset, "startup_s": time.perf_counter() - t0, "decode": []}
    expert_b, other_b = _split_weights(llm)
    res["expert_weight_bytes"], res["other_weight_bytes"] = expert_b, other_b
    bw = limits["copy_bandwidth_Bps"]
    cases = [(1, 1024), (32, 1024), (1, 16384), (32, 16384)] + ([(8, LONG_CTX)] if long else [])
    for batch, ctx in cases:
        r = _decode(llm, batch, ctx)
        r["roofline_ms"] = _roofline_bytes(cfg, batch, ctx, expert_b, other_b) / bw * 1e3
        r["ratio"] = r["step_ms"] / r["roofline_ms"]
        res["decode"].append(r)
        print(json.dumps(r), flush=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = _prompt(16384, 99)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], sp)
    torch.cuda.synchronize()
    res["prefill_16k_s"] = time.perf_counter() - t0
    del llm
    _free()
    if hf_peer:
        res["transformers"] = _hf_speed(path, dummy, [(1, 1024), (32, 1024), (1, 16384)])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="accuracy,speed")
    ap.add_argument("--presets", default="glm5-s4-e16,glm5-m12-e64")
    ap.add_argument("--workdir", default="/tmp/glm5")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' speed runs")
    ap.add_argument("--long", action="store_true", help="also decode at batch 8 x 128K")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["limits"] = measure_limits()
    if "accuracy" in sections:
        res["accuracy"] = bench_accuracy(workdir)
        print(json.dumps(res["accuracy"]), flush=True)
    if "speed" in sections:
        res["speed"] = [
            bench_speed(p, workdir, res["limits"], not args.no_peer, args.long)
            for p in args.presets.split(",")
        ]
    Path(args.out).write_text(json.dumps(res, indent=2))
    _table(res)


def _table(res: dict) -> None:
    lim = res["limits"]
    print(
        f"\n== {res['gpu']} | torch {res['torch']} | copy {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s"
    )
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
            f"\n{sp['preset']}: start-up {sp['startup_s']:.0f}s, prefill 16K {sp['prefill_16k_s']:.2f}s"
        )
        print(" batch    ctx   step ms   roof ms  ratio  graph steps")
        for r in sp["decode"]:
            print(
                f"{r['batch']:6d} {r['ctx']:6d} {r['step_ms']:9.2f} {r['roofline_ms']:9.2f} "
                f"{r['ratio']:6.2f}  {r['graph_steps']}"
            )
        hf = sp.get("transformers")
        if hf:
            dec = ", ".join(f"{d['batch']}x{d['ctx']}: {_ms(d['step_ms'])}" for d in hf["decode"])
            print(f" transformers: prefill 16K {hf['prefill_16k_s']}, decode {dec}")


def _ms(v: float | str) -> str:
    return v if isinstance(v, str) else f"{v:.1f} ms"


if __name__ == "__main__":
    main()
