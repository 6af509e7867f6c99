"""Start-up warm-up reaches every attention path traffic can take before the engine is ready."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.layers.embedding import LMHead
from pdserve.layers.linear import Linear
from pdserve.runner.warmup import (
    PAGED_WARMUP_QUERY_LENS,
    dummy_gemms,
    dummy_paged_runs,
    gemm_warmup_token_counts,
    prompt_warmup_lens,
)


def test_warm_up_runs_mixed_batches_with_cached_prefixes(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, max_num_batched_tokens=128)
    runner = llm.engine.runner
    seen = []
    backend = runner.step.backends["attn"]
    orig = backend.forward

    def spy(q, k, v, kv_cache, md, *rest):  # type: ignore[no-untyped-def]
        c = getattr(md, "common", md)
        seen.append((c.num_reqs, c.max_query_len, c.max_seq_len, c.block_size))
        return orig(q, k, v, kv_cache, md, *rest)

    backend.forward = spy  # type: ignore[method-assign]
    blocks_before = llm.engine.kv.pool.num_free_blocks
    runner.warm_up()
    layers = llm.engine.runner.hf_config.num_hidden_layers
    mixed = {s for s in seen if s[0] == 2}
    # one mixed batch per tile size of the paged prefill kernel, each over a cached
    # prefix (so not the single-prompt SDPA path), in the real cache's block size
    assert {(2, q, q + 4, 4) for q in PAGED_WARMUP_QUERY_LENS} == mixed
    assert sum(1 for s in seen if s[0] == 2) == layers * len(mixed)
    assert llm.engine.kv.pool.num_free_blocks == blocks_before
    # and the engine still serves correctly after touching only the null block
    out = llm.generate(
        [[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_paged_dummies_leave_real_blocks_untouched(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4)
    runner = llm.engine.runner
    caches = [c for _, _, c in runner.kv_caches.layers()]
    before = [c[:, 1:].clone() for c in caches]
    dummy_paged_runs(runner.step, runner.max_num_tokens)
    for b, c in zip(before, caches, strict=True):
        assert torch.equal(b, c[:, 1:])  # only block 0, the null block, may change


def test_prompt_warmup_lens() -> None:
    # a GPU: every power of two and the odd count below it (tile sizes x divisibility)
    assert prompt_warmup_lens(128, True) == [15, 16, 31, 32, 63, 64, 127, 128]
    assert prompt_warmup_lens(100, True) == [15, 16, 31, 32, 63, 64, 99, 100]
    # a CPU: nothing compiles, a few sizes check the paths
    assert prompt_warmup_lens(256, False) == [16, 64, 256]
    assert prompt_warmup_lens(8, True) == [7, 8] and prompt_warmup_lens(1, True) == [1]


def test_gemm_token_counts() -> None:
    counts = gemm_warmup_token_counts(8192)
    assert counts[:128] == list(range(1, 129))
    assert counts[-1] == 8192 and counts == sorted(set(counts))
    assert {136, 1000, 1024, 1056, 8160} <= set(counts)
    assert not {129, 1001, 1040} & set(counts)
    assert gemm_warmup_token_counts(100) == list(range(1, 101))


def test_gemm_sweep_runs_each_linear_shape_once_per_count(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=160, max_num_seqs=4)
    r = llm.engine.runner
    calls: list[tuple[tuple[int, ...], int]] = []
    for mod in r.model.modules():
        if isinstance(mod, (Linear, LMHead)):

            def hook(m, args, shape=tuple(mod.weight.shape)):  # type: ignore[no-untyped-def]
                calls.append((shape, args[0].shape[0]))

            mod.register_forward_pre_hook(hook)
    dummy_gemms(r.step, r.max_num_reqs, r.max_num_tokens)
    counts = gemm_warmup_token_counts(160)
    hc = r.hf_config
    lm_head = (hc.vocab_size, hc.hidden_size)
    layer_shapes = {s for s, _ in calls} - {lm_head}
    assert len(layer_shapes) == 4  # qkv, o, gate_up, down: each distinct shape once
    for s in layer_shapes:
        assert [m for sh, m in calls if sh == s] == counts
    assert [m for sh, m in calls if sh == lm_head] == [1, 2, 3, 4]
