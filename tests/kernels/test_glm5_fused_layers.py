"""A tiny GLM-5 with every fused kernel on (``PDSERVE_FUSED_KERNELS=1``: the fused norms,
the MLA and indexer preparation kernels that write the caches, the MoE router, token
alignment and experts) gives the logits of the unfused torch model: with the Triton MLA
and indexer backends, over a prompt longer than index_topk and decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint


# DeepSeek-V3.2: the half-split indexer RoPE, YaRN tables, grouped routing (n_group 2)
@pytest.mark.parametrize("arch", ["GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"])
def test_tiny_glm5_fused_layers_match_torch_layers(
    arch: str, tmp_path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two layers (one dense, one MoE with an indexer) keep the interpreter fast
    ckpt = make_checkpoint(
        arch, "tiny", tmp_path, seed=4, dtype="float32", config_overrides={"num_hidden_layers": 2}
    )
    models = []
    for mode in ("0", "1"):
        monkeypatch.setenv("PDSERVE_FUSED_KERNELS", mode)
        models.append(load_model(ckpt, "float32", device)[0])
    ref, fast = models
    assert fast.model.rotary_emb.fused and not ref.model.rotary_emb.fused
    kvs = [PagedKV(ref, 2, 40, 4, "torch"), PagedKV(fast, 2, 40, 4, "triton")]
    vocab = fast.config.vocab_size
    g = torch.Generator().manual_seed(6)
    computed = [0, 0]
    # request 0 outgrows index_topk (16): sparse; request 1 stays within it: dense
    for new in ([17, 3], [1, 1]):
        ids = torch.randint(3, vocab, (sum(new),), generator=g).to(device)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
        logits = []
        for m, kv in zip(models, kvs, strict=True):
            with torch.no_grad(), kv.step(computed, new):
                logits.append(m.compute_logits(m(ids, pos.to(device))))
        torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=2e-4)
        computed = [c + n for c, n in zip(computed, new, strict=True)]
    for a, b in zip(kvs[0].kv_caches, kvs[1].kv_caches, strict=True):  # same cache rows
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
