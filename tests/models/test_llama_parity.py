"""pdserve's Llama/Qwen3 against transformers on tiny random checkpoints (CPU, float32).

Prompts of different lengths run as one flat batch through the paged reference
attention (block size 4, so every sequence spans several blocks); the next
steps reuse the cache that step wrote. transformers runs each full sequence
without a cache, so any cache or position bug shows up as a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
PROMPT_LENS = (5, 70, 11)  # 70 crosses the tiny llama3 scaling's original context (64)
MAX_REL_ERR = 1e-4


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _random_ids(n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_match_transformers(arch: str, loaded_tiny, hf_tiny) -> None:
    model, cfg = loaded_tiny(arch)
    hf = hf_tiny(arch)
    g = torch.Generator().manual_seed(0)
    seqs = [_random_ids(n, cfg.vocab_size, g) for n in PROMPT_LENS]
    kv = PagedKV(model, len(seqs), 96)

    # (a) prefill: all prompts in one flat batch
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad(), kv.step([0] * len(seqs), [len(s) for s in seqs]):
        hidden = model(ids, positions)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (len(ids), cfg.hidden_size)
    assert logits.shape == (len(ids), cfg.vocab_size) and logits.dtype == torch.float32
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert _rel_err(logits, ref) <= MAX_REL_ERR

    # (b) decode: one more token per sequence on top of the cached prefix, twice
    for _ in range(2):
        computed = [len(s) for s in seqs]
        new = _random_ids(len(seqs), cfg.vocab_size, g)
        seqs = [torch.cat([s, new[i : i + 1]]) for i, s in enumerate(seqs)]
        with torch.no_grad(), kv.step(computed, [1] * len(seqs)):
            logits = model.compute_logits(model(new, torch.tensor(computed)))
        with torch.no_grad():
            ref = torch.stack([hf(s[None]).logits[0, -1] for s in seqs])
        assert _rel_err(logits, ref) <= MAX_REL_ERR


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_step_chunked_prefill_and_decode(arch: str, loaded_tiny, hf_tiny) -> None:
    """One step where a request continues its prompt by a chunk while another decodes."""
    model, cfg = loaded_tiny(arch)
    hf = hf_tiny(arch)
    g = torch.Generator().manual_seed(1)
    full = [_random_ids(n, cfg.vocab_size, g) for n in (23, 9)]
    kv = PagedKV(model, 2, 32)
    first = [13, 8]  # step 1: a 13-token chunk of request 0, all but one token of request 1
    with torch.no_grad(), kv.step([0, 0], first):
        model(
            torch.cat([s[:n] for s, n in zip(full, first, strict=True)]),
            torch.cat([torch.arange(n) for n in first]),
        )
    rest = [len(s) - n for s, n in zip(full, first, strict=True)]  # step 2: 10 tokens + 1 token
    ids = torch.cat([s[n:] for s, n in zip(full, first, strict=True)])
    positions = torch.cat([torch.arange(n, len(s)) for s, n in zip(full, first, strict=True)])
    with torch.no_grad(), kv.step(first, rest):
        logits = model.compute_logits(model(ids, positions))
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0, n:] for s, n in zip(full, first, strict=True)])
    assert _rel_err(logits, ref) <= MAX_REL_ERR


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_runs(arch: str, dtype: torch.dtype, tiny_ckpts: dict[str, Path]) -> None:
    model, cfg = load_model(tiny_ckpts[arch], dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    lens = [6, 3]
    kv = PagedKV(model, 2, 16)
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), kv.step([0, 0], lens):
        hidden = model(ids, torch.cat([torch.arange(n) for n in lens]))
        logits = model.compute_logits(hidden)
    assert hidden.shape == (sum(lens), cfg.hidden_size) and hidden.dtype == dtype
    assert logits.shape == (sum(lens), cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    with torch.no_grad(), kv.step(lens, [1, 1]):
        logits = model.compute_logits(model(ids[:2], torch.tensor(lens)))
    assert logits.shape == (2, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tied_and_untied_heads(loaded_tiny) -> None:
    llama, _ = loaded_tiny("LlamaForCausalLM")
    qwen, _ = loaded_tiny("Qwen3ForCausalLM")
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert "lm_head.weight" in llama.checkpoint_tensor_names()
    assert "lm_head.weight" not in qwen.checkpoint_tensor_names()
    assert "model.layers.0.self_attn.q_norm.weight" in qwen.checkpoint_tensor_names()
    assert "model.layers.0.self_attn.q_norm.weight" not in llama.checkpoint_tensor_names()


def test_llama_variant_with_biases_and_tied_head(tmp_path: Path) -> None:
    """attention_bias, mlp_bias and a tied head on Llama (paths the default presets skip)."""
    transformers = pytest.importorskip("transformers")
    overrides = {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}
    d = make_checkpoint(
        "LlamaForCausalLM", "tiny", tmp_path, dtype="float32", config_overrides=overrides
    )
    model, cfg = load_model(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seqs = [_random_ids(n, cfg.vocab_size, torch.Generator().manual_seed(3)) for n in (4, 13)]
    kv = PagedKV(model, 2, 16)
    with torch.no_grad(), kv.step([0, 0], [len(s) for s in seqs]):
        logits = model.compute_logits(
            model(torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs]))
        )
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert _rel_err(logits, ref) <= MAX_REL_ERR
