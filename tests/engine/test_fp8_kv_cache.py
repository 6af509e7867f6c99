"""``--kv-cache-dtype fp8``: float8_e4m3fn GQA and MLA caches (here without checkpoint
scales: 1.0) and the DSA indexer's fp8 keys with a float32 scale a key, through the
engine, prefix caching and tcp P/D, and the handshake that refuses a mixed pair (dtypes
or per-layer scales; the scales themselves: ``tests/models/test_kv_cache_scales.py``).

Closeness to the float32 cache: teacher-forced decode logits within 5% of the largest
|logit| (Llama and GLM-5); greedy tokens (tiny random models, whose choices sit on
near-ties) agree on the first 4 of every prompt and on at least 70% overall. With the
fp8 cache itself every path (prefix hits, chunked prefill, a tcp transfer) gives
identical tokens, since each reads the same fp8 bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from _pd_engines import PROMPTS, engine, handoff_error, prefill, proc, run, settle, tokens
from pdserve import LLM, SamplingParams
from pdserve.forward_context import KVCaches
from pdserve.layers.moe import TopKRouter
from pdserve.models import load_model
from pdserve.runner.model_step import collect_cache_layers

SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _gen(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def fp8_llm(tiny_llama: Path) -> LLM:
    """fp8 cache; a 16-token budget, so the longer prompts prefill in chunks."""
    return LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        kv_cache_dtype="fp8",
        max_num_batched_tokens=16,
    )


@pytest.fixture(scope="module")
def fp8_reference(fp8_llm: LLM) -> list[list[int]]:
    return _gen(fp8_llm)


def _assert_close_to(got: list[list[int]], want: list[list[int]]) -> None:
    assert all(g[:4] == w[:4] for g, w in zip(got, want, strict=True))
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.7 * sum(len(w) for w in want)


def test_fp8_cache_is_close_to_float_and_exact_through_prefix_caching(
    tiny_llama: Path, fp8_llm: LLM, fp8_reference: list[list[int]]
) -> None:
    layout = fp8_llm.engine.runner.step.kv_cache_config.groups[0].layout
    assert layout.dtype == "float8_e4m3fn" and layout.bytes_per_block == 2 * 4 * 2 * 16
    _assert_close_to(fp8_reference, _gen(LLM(str(tiny_llama), dtype="float32", block_size=4)))
    before = fp8_llm.engine.stats().prefix_cache_hits
    assert _gen(fp8_llm) == fp8_reference  # every full prompt block from the prefix cache
    assert fp8_llm.engine.stats().prefix_cache_hits > before


def _decode_logits(model: torch.nn.Module, ids: list[int], fp8: bool) -> torch.Tensor:
    """Logits of the last token of ``ids``, computed as a decode step over a cache the
    rest of the prompt filled (float32 or fp8 GQA / MLA caches)."""
    kv = PagedKV(model, 1, 64)
    if fp8:
        cfg, _ = collect_cache_layers(model, kv.block_size, "float32", "float8_e4m3fn")
        kv.caches = KVCaches.allocate(cfg, kv.caches.num_blocks, kv.device)
    n, t = len(ids), torch.tensor(ids)
    with kv.step([0], [n - 1]):
        model(t[:-1], torch.arange(n - 1))
    with kv.step([n - 1], [1]):
        return model.compute_logits(model(t[-1:], torch.tensor([n - 1])))


@pytest.mark.parametrize("arch", ["llama", "glm5"])
def test_fp8_cache_decode_logits_close_to_float(
    tiny_llama: Path, tiny_glm5: Path, arch: str
) -> None:
    """Teacher-forced, so near-ties cannot compound: the decode step reading an fp8 cache
    stays within 5% (of the largest |logit|) of the one reading float32. GLM-5 routes
    every token to every expert here, so no top-2 routing choice flips on a near-tie."""
    model, _ = load_model(tiny_llama if arch == "llama" else tiny_glm5, "float32")
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.top_k = m.weight.shape[0]
    ids = PROMPTS[3][:14]  # within the tiny GLM-5's index_topk: the same keys either way
    ref, got = _decode_logits(model, ids, False), _decode_logits(model, ids, True)
    layouts = {
        g.layout.kind: g.layout
        for g in collect_cache_layers(model, 4, "float32", "float8_e4m3fn")[0].groups
    }
    assert layouts.get("gqa", layouts.get("mla")).dtype == "float8_e4m3fn"  # type: ignore[union-attr]
    if arch == "glm5":  # 4 keys a block: 32 fp8 bytes and a float32 scale each
        assert layouts["indexer"].dtype == "uint8"
        assert layouts["indexer"].bytes_per_block == 4 * (32 + 4)
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.05


def test_fp8_cache_over_tcp_pd_is_exact_and_a_mixed_pair_is_refused(
    tiny_llama: Path, fp8_reference: list[list[int]]
) -> None:
    p = engine(tiny_llama, "kv_producer", kv_cache_dtype="fp8")
    d = engine(tiny_llama, "kv_consumer", kv_cache_dtype="fp8")
    try:
        pp, dp = proc(p, tiny_llama), proc(d, tiny_llama)
        for i, ids in enumerate(PROMPTS):
            d.add_request(dp.make_request(f"r{i}", ids, SP, prefill(p, pp, f"r{i}", ids)))
        outs = run(d, {f"r{i}" for i in range(len(PROMPTS))})
        assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == fp8_reference
        assert d.stats().kv_transfer_failures == 0
        settle(p, d)
    except BaseException:
        p.shutdown()
        raise
    finally:
        d.shutdown()
    # the same fp8 prefill instance against a float32-cache decode instance
    error = handoff_error(p, engine(tiny_llama, "kv_consumer"), tiny_llama)  # shuts both down
    assert "kv_cache_dtype (prefill {'attn': 'float8_e4m3fn'}, decode {'attn': 'float32'})" in error


def test_prefill_and_decode_with_different_kv_cache_scales_are_refused(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """fp8 bytes written under one set of per-layer scales would decode wrong under
    another: the handshake compares a digest of them."""
    import shutil

    from safetensors.torch import save_file

    from pdserve.models.kv_scales import KV_SCALES_FILE

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_llama, scaled)
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.01)}, scaled / KV_SCALES_FILE)
    p = engine(scaled, "kv_producer", kv_cache_dtype="fp8")
    error = handoff_error(p, engine(tiny_llama, "kv_consumer", kv_cache_dtype="fp8"), tiny_llama)
    assert "kv_cache_scales (prefill 'sha256:" in error and "over 2 layers" in error
    assert "kv_cache_dtype" not in error  # the same dtype: only the scales differ


def test_unsupported_kv_cache_dtype_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3"):
        LLM(str(tiny_llama), kv_cache_dtype="fp8_e5m2")


def test_glm5_fp8_indexer_keys_through_the_engine_and_tcp_pd(tiny_glm5: Path) -> None:
    """GLM-5 with an fp8 cache (latents and indexer keys; prompts past index_topk, so the
    indexer's selection over fp8 keys decides what attention reads): the indexer caches
    hold fp8 keys and positive per-key scales; prefix-cache hits and a tcp P/D transfer
    of both groups (the indexer's as uint8 blocks) give the same tokens."""
    prompts = [PROMPTS[1], PROMPTS[3]]  # 16 and 33 tokens: within and past index_topk 16
    llm = LLM(str(tiny_glm5), dtype="float32", block_size=4, kv_cache_dtype="fp8")
    want = _gen(llm, prompts)
    groups = {g.name: g for g in llm.engine.runner.step.kv_cache_config.groups}
    assert groups["indexer"].layout.dtype == "uint8"
    from pdserve.kernels.index_cache import indexer_cache_views

    name = groups["indexer"].layer_names[0]
    _, scales = indexer_cache_views(llm.engine.runner.kv_caches[name], 32)
    assert scales is not None and int((scales > 0).sum()) >= len(prompts[1])
    assert _gen(llm, prompts) == want  # prefix hits read the same fp8 keys and scales
    p = engine(tiny_glm5, "kv_producer", kv_cache_dtype="fp8")
    d = engine(tiny_glm5, "kv_consumer", kv_cache_dtype="fp8")
    try:
        pp, dp = proc(p, tiny_glm5), proc(d, tiny_glm5)
        for i, ids in enumerate(prompts):
            d.add_request(dp.make_request(f"r{i}", ids, SP, prefill(p, pp, f"r{i}", ids)))
        outs = run(d, {f"r{i}" for i in range(len(prompts))}, limit=120.0)
        assert [tokens(outs[f"r{i}"]) for i in range(len(prompts))] == want
        assert d.stats().kv_transfer_failures == 0
        settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()
