"""A tiny GLM-5 with every fused kernel on (``PDSERVE_FUSED_KERNELS=1``: the fused norms,
the MLA and indexer preparation kernels that write the caches, the MoE router, token
alignment and experts) gives the logits of the unfused torch model: with the Triton MLA
and indexer backends, over a prompt longer than index_topk and decode steps. With an fp8
cache too (``--kv-cache-dtype fp8``: fp8 latents; fp8 indexer keys quantized per key by
the fused prep kernel on one side, by torch on the other)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from pdserve.forward_context import KVCaches
from pdserve.kernels import skinny_gemm
from pdserve.kernels.index_cache import dequantize_index_cache
from pdserve.kernels.reference import FP8_DTYPE
from pdserve.layers.attention.dsa import Indexer
from pdserve.layers.linear import Linear
from pdserve.models import load_model
from pdserve.runner.model_step import collect_cache_layers
from pdserve.testing.checkpoint import make_checkpoint


# DeepSeek-V3.2: the half-split indexer RoPE, YaRN tables, grouped routing (n_group 2);
# skinny: the fused model's linears take the two-row decode step on the decode-size GEMM
@pytest.mark.parametrize(
    "arch,fp8,skinny",
    [("GlmMoeDsaForCausalLM", False, False), ("DeepseekV32ForCausalLM", False, False),
     ("GlmMoeDsaForCausalLM", True, False), ("GlmMoeDsaForCausalLM", False, True)],
)  # fmt: skip
def test_tiny_glm5_fused_layers_match_torch_layers(
    arch: str, fp8: bool, skinny: bool, tmp_path: Path, device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # two layers (one dense, one MoE with an indexer) keep the interpreter fast
    ckpt = make_checkpoint(
        arch, "tiny", tmp_path, seed=4, dtype="float32", config_overrides={"num_hidden_layers": 2}
    )
    models = []
    if skinny:
        monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "2")
    else:
        monkeypatch.delenv("PDSERVE_SKINNY_ROWS", raising=False)
    for mode in ("0", "1"):
        monkeypatch.setenv("PDSERVE_FUSED_KERNELS", mode)
        models.append(load_model(ckpt, "float32", device)[0])
    ref, fast = models
    assert fast.model.rotary_emb.fused and not ref.model.rotary_emb.fused
    # the family's default (GlmMoeDsaForCausalLM.skinny_rows): cuBLAS until measured
    rows = {m.skinny_rows for m in fast.modules() if isinstance(m, Linear)}
    assert rows == {2 if skinny else 0}
    ran: list[int] = []  # the rows of each decode-size GEMM call
    run = skinny_gemm.skinny_gemm

    def spy(x, *args, **kw):  # type: ignore[no-untyped-def]
        ran.append(x.numel() // x.shape[-1])
        return run(x, *args, **kw)

    monkeypatch.setattr(skinny_gemm, "skinny_gemm", spy)
    kvs = [PagedKV(ref, 2, 40, 4, "torch"), PagedKV(fast, 2, 40, 4, "triton")]
    if fp8:
        for m, kv in zip(models, kvs, strict=True):
            cfg, _ = collect_cache_layers(m, 4, "float32", "float8_e4m3fn")
            kv.caches = KVCaches.allocate(cfg, kv.caches.num_blocks, device)
        assert {g.layout.dtype for g in cfg.groups} == {"float8_e4m3fn", "uint8"}
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
        # fp8: a value that rounds the other way (LayerNorm's last bits) moves them a little
        tol = 2e-3 if fp8 else 2e-4
        torch.testing.assert_close(logits[1], logits[0], atol=tol, rtol=tol)
        computed = [c + n for c, n in zip(computed, new, strict=True)]
    # the decode step's projections, shared experts and the dense layer's MLP
    assert (len(ran) > 10 and set(ran) == {2}) if skinny else not ran
    if not fp8:
        for a, b in zip(kvs[0].kv_caches, kvs[1].kv_caches, strict=True):  # same cache rows
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        return
    head_dim = next(m.head_dim for m in fast.modules() if isinstance(m, Indexer))
    for (_, lay, a), (_, _, b) in zip(kvs[0].caches.layers(), kvs[1].caches.layers(), strict=True):
        if lay.kind == "indexer":  # same keys and scales, within one e4m3 step
            a, b = (dequantize_index_cache(c, head_dim) for c in (a, b))
            assert int((a != 0).any(-1).sum()) == sum(computed)
        else:
            a, b = (c.view(FP8_DTYPE).float() for c in (a, b))
        assert bool(((b - a).abs() <= a.abs() / 8 + 1e-3).all())
