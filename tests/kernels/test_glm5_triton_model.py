"""A tiny GLM-5 (DSA + MoE) gives the same logits on the Triton path (the Triton MLA and
indexer backends, the router kernel and the fused MoE; the interpreter on a CPU) as on the torch reference
path: prompts beyond and within index_topk, then verify-shaped decode steps."""

from __future__ import annotations

from pathlib import Path

import torch

from _attn_helper import PagedKV
from pdserve.layers.moe import MoE
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint


def test_tiny_glm5_triton_path_matches_reference(tmp_path: Path, device: torch.device) -> None:
    # two layers (one dense, one MoE with an indexer) keep the interpreter under ~20 s
    ckpt = make_checkpoint(
        "GlmMoeDsaForCausalLM", "tiny", tmp_path, seed=3, dtype="float32",
        config_overrides={"num_hidden_layers": 2},
    )  # fmt: skip
    ref, cfg = load_model(ckpt, "float32", device)
    fast, _ = load_model(ckpt, "float32", device)
    moes = [m for m in fast.modules() if isinstance(m, MoE)]
    assert moes
    for m in moes:  # the Triton router and experts; dense layers stay on torch ops
        m.gate.fused = m.experts.fused = True
    kvs = [PagedKV(ref, 2, 40, 4, "torch"), PagedKV(fast, 2, 40, 4, "triton")]
    assert type(kvs[1].backends["mla"]).__name__ == "MLATritonBackend"
    assert type(kvs[1].backends["indexer"]).__name__ == "IndexerTritonBackend"
    g = torch.Generator().manual_seed(5)
    computed = [0, 0]
    # request 0 outgrows index_topk (16): sparse; request 1 stays within it: dense
    for new in ([24, 5], [2, 2], [2, 2]):
        ids = torch.randint(3, cfg.vocab_size, (sum(new),), generator=g).to(device)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
        logits = []
        for m, kv in zip((ref, fast), kvs, strict=True):
            with torch.no_grad(), kv.step(computed, new):
                logits.append(m.compute_logits(m(ids, pos.to(device))))
        torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=2e-4)
        computed = [c + n for c, n in zip(computed, new, strict=True)]
