"""Both tiny architectures give the same logits with the fused Triton RMSNorm/RoPE/SiLU-mul kernels
as with the torch layers (on the CPU through TRITON_INTERPRET, on a GPU compiled); with the
Triton attention backend the fused model rotates q/k and writes K/V in one launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_backends import BLOCK, _metadata

from _attn_helper import model_caches
from pdserve.forward_context import set_forward_context
from pdserve.kernels import skinny_gemm as skinny
from pdserve.layers.attention.backend import AttentionBackend
from pdserve.layers.attention.torch_ref import TorchReferenceBackend
from pdserve.layers.attention.triton_backend import TritonAttentionBackend
from pdserve.models import load_model


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fused_layers_match_torch_layers(
    tiny_ckpts: dict[str, Path],
    device: torch.device,
    arch: str,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    models = []
    monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "16")  # decode rows: the decode-size GEMM
    for mode in ("0", "1"):
        monkeypatch.setenv("PDSERVE_FUSED_KERNELS", mode)
        model, cfg = load_model(tiny_ckpts[arch], "float32", device)
        models.append(model)
    assert not models[0].model.norm.fused and models[1].model.norm.fused
    assert models[1].model.rotary_emb.fused
    assert models[1].model.layers[0].mlp.act_fn.fused
    # decode rows take the decode-size GEMM (one row: SiLU-and-mul as its prologue)
    assert models[1].model.layers[0].mlp.down_proj.skinny_rows > 0
    assert models[0].model.layers[0].mlp.down_proj.skinny_rows == 0
    bt = (1 + torch.arange(8)).view(2, 4).to(torch.int32).to(device)
    bes: list[AttentionBackend] = [TorchReferenceBackend()]
    bes.append(TritonAttentionBackend() if backend == "triton" else TorchReferenceBackend())
    caches = [model_caches(m, 9, BLOCK) for m in models]
    g = torch.Generator().manual_seed(3)
    folded: list[str] = []  # the prologues the decode-size GEMM ran in this step
    run = skinny.skinny_gemm

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        folded.append(kw.get("prologue", "none"))
        return run(*args, **kw)

    monkeypatch.setattr(skinny, "skinny_gemm", spy)
    computed = [0, 0]
    # prompts, a decode step of both (two rows: SiLU-and-mul launched first), then one of
    # the first alone (one row: SiLU-and-mul folded into down's launch; the norms are
    # launched first at any rows, skinny_gemm.prologue_pays)
    for reqs, new in (([0, 1], [11, 30]), ([0, 1], [1, 1]), ([0], [1])):
        done = [computed[r] for r in reqs]
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g).to(device)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(done, new, strict=True)])
        md = _metadata(done, new, bt[reqs], device)
        logits = []
        folded.clear()
        for model, cache, be in zip(models, caches, bes, strict=True):
            ctx = set_forward_context({"attn": be}, {"attn": be.build_metadata(md)}, cache)
            with torch.no_grad(), ctx:
                logits.append(model.compute_logits(model(ids, pos.to(device))))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
        want = {1: {"none", "silu_mul"}, 2: {"none"}}.get(sum(new), set())
        assert set(folded) == want, (new, folded)
        for r, n in zip(reqs, new, strict=True):
            computed[r] += n
