"""Start-up warm-up reaches every attention path traffic can take before the engine is ready."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.runner.warmup import PAGED_WARMUP_QUERY_LENS, dummy_paged_runs


def test_warm_up_runs_mixed_batches_with_cached_prefixes(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, max_num_batched_tokens=128)
    runner = llm.engine.runner
    seen = []
    orig = runner.backend.forward

    def spy(q, k, v, kv_cache, md, scale):  # type: ignore[no-untyped-def]
        c = getattr(md, "common", md)
        seen.append((c.num_reqs, c.max_query_len, c.max_seq_len, c.block_size))
        return orig(q, k, v, kv_cache, md, scale)

    runner.backend.forward = spy  # type: ignore[method-assign]
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
    caches = llm.engine.runner.kv_caches
    before = [c[:, 1:].clone() for c in caches]
    dummy_paged_runs(llm.engine.runner)
    for b, c in zip(before, caches, strict=True):
        assert torch.equal(b, c[:, 1:])  # only block 0, the null block, may change
