"""The GLM-5 family through pdserve's own machinery: its cache groups, MLA's absorbed form
against transformers' expanded one, chunked prefill and prefix-cache hits around
index_topk, GLM-5.2 index sharing, the MTP layer, and checkpoints that must be refused."""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _attn_helper import PagedKV
from pdserve import LLM, SamplingParams
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint

transformers = pytest.importorskip("transformers")
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm  # noqa: E402

TOPK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _glm52(tmp: Path, **extra: object) -> Path:
    """A tiny GLM-5.2-style checkpoint: index sharing F, S, F, S (freq 2, offset 1)."""
    over = {"index_topk_freq": 2, "index_skip_topk_offset": 1, **extra}
    return make_checkpoint(
        "GlmMoeDsaForCausalLM", "tiny", tmp, seed=2, dtype="float32", config_overrides=over
    )


def test_cache_groups_are_the_latent_and_the_indexer_keys(tiny_glm5: Path, tmp_path: Path) -> None:
    cfg = LLM(str(tiny_glm5), dtype="float32", block_size=4).engine.runner.kv_cache_config
    groups = {g.name: g for g in cfg.groups}
    assert groups["mla"].layout.page_shape == (1, 4, 64 + 16)  # kv_lora_rank + rope dims
    assert groups["indexer"].layout.page_shape == (1, 4, 32)  # index_head_dim
    assert len(groups["mla"].layer_names) == len(groups["indexer"].layer_names) == 4
    # index-sharing layers own no indexer cache
    shared = LLM(str(_glm52(tmp_path)), dtype="float32", block_size=4).engine.runner.kv_cache_config
    names = {g.name: g.layer_names for g in shared.groups}
    assert names["indexer"] == (
        "model.layers.0.self_attn.indexer",
        "model.layers.2.self_attn.indexer",
    )
    assert len(names["mla"]) == 4


def test_mla_absorbed_attention_matches_hf_expanded(tiny_glm5: Path) -> None:
    """One MLA layer, pdserve's absorbed form over the paged latent cache against HF's
    expanded K/V: a prompt shorter and one longer than top-k, then a verify step of 4
    rows on top of a cached prefix (row j sees the prefix plus j + 1 keys)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_glm5, dtype=torch.float32).eval()
    model, cfg = load_model(tiny_glm5, "float32")
    hf_attn = hf.model.layers[1].self_attn
    ours = model.model.layers[1].self_attn  # type: ignore[union-attr,index]
    for n in (TOPK - 3, 3 * TOPK):
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n)) * 0.5
        pos = torch.arange(n)
        mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
        with torch.no_grad():
            ref = hf_attn(x[None], hf.model.rotary_emb(x[None], pos[None]), mask)[0][0]
            kv = PagedKV(model, 1, n + 8)
            rope = model.model.rotary_emb.prepare  # type: ignore[union-attr]
            with kv.step([0], [n - 4]):
                ours(x[: n - 4], rope(pos[: n - 4]), None)
            with kv.step([n - 4], [4]):
                verify, _ = ours(x[n - 4 :], rope(pos[n - 4 :]), None)
            kv2 = PagedKV(model, 1, n + 8)
            with kv2.step([0], [n]):
                whole, _ = ours(x, rope(pos), None)
        torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(verify, ref[n - 4 :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [TOPK - 1, TOPK, TOPK + 1, 7])
def test_chunked_prefill_is_identical(tiny_glm5: Path, chunk: int) -> None:
    prompts = _prompts((3 * TOPK + 5, 2 * TOPK))
    whole = _tokens(LLM(str(tiny_glm5), dtype="float32", block_size=4), prompts)
    chunked = LLM(str(tiny_glm5), dtype="float32", block_size=4, max_num_batched_tokens=chunk)
    assert _tokens(chunked, prompts) == whole


def test_prefix_cache_hits_reuse_latents_and_indexer_keys(tiny_glm5: Path) -> None:
    prompts = _prompts((3 * TOPK + 3,))
    base = prompts[0]
    aligned = base[:32] + _prompts((20,), seed=5)[0]  # shares 8 full blocks
    mid = base[:30] + _prompts((20,), seed=6)[0]  # shares 7 blocks and half of the 8th
    cold = LLM(str(tiny_glm5), dtype="float32", block_size=4, enable_prefix_caching=False)
    want = _tokens(cold, [base, aligned, mid])
    llm = LLM(str(tiny_glm5), dtype="float32", block_size=4)
    assert _tokens(llm, [base]) == want[:1]
    hits = llm.engine.stats().prefix_cache_hits
    assert _tokens(llm, [aligned]) == want[1:2]
    assert llm.engine.stats().prefix_cache_hits - hits == 32
    assert _tokens(llm, [mid]) == want[2:]
    assert llm.engine.stats().prefix_cache_hits - hits == 32 + 28


def test_index_sharing_matches_transformers(tmp_path: Path) -> None:
    """GLM-5.2's shared layers reuse the previous full layer's top-k (F, S, F, S); and an
    explicit index_topk_pattern gives the same model."""
    path = _glm52(tmp_path / "freq")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.indexer_types == ["full", "shared", "full", "shared"]
    prompts = _prompts((3 * TOPK,), seed=3)
    ours = _tokens(
        LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=20), prompts
    )
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(prompts), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
    assert ours == [ref[0, len(prompts[0]) :].tolist()]
    pattern = make_checkpoint(
        "GlmMoeDsaForCausalLM", "tiny", tmp_path / "pattern", seed=2, dtype="float32",
        config_overrides={"index_topk_pattern": "FSFS"},
    )  # fmt: skip
    assert _tokens(LLM(str(pattern), dtype="float32", block_size=4), prompts) == ours


def _hf_mtp_reference(hf, tensors: dict[str, torch.Tensor], n_layers: int):  # type: ignore[no-untyped-def]
    """The MTP layer assembled from transformers' parts (HF has none), with the
    checkpoint's layer-N tensors."""
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = 1
    cfg.mlp_layer_types = ["sparse"]
    cfg.indexer_types = ["full"]
    # the attention layer type this transformers names (5.24: "indexed_attention"; older
    # releases had another name, and their cache has no entry for the new one)
    if getattr(hf.config, "layer_types", None):
        cfg.layer_types = hf.config.layer_types[:1]
    block = hf_glm.GlmMoeDsaDecoderLayer(cfg, 0)
    h = cfg.hidden_size
    parts = torch.nn.ModuleDict(
        {
            "enorm": hf_glm.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps),
            "hnorm": hf_glm.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps),
            "shared_head_norm": hf_glm.GlmMoeDsaRMSNorm(h, cfg.rms_norm_eps),
            "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
        }
    )
    pre = f"model.layers.{n_layers}."
    own = {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}
    e = cfg.n_routed_experts
    block_sd = {
        k: v
        for k, v in own.items()
        if k.startswith(("self_attn.", "input_layernorm.", "post_attention_layernorm."))
        or k.startswith(("mlp.gate.", "mlp.shared_experts."))
    }
    block_sd["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [own[f"mlp.experts.{i}.gate_proj.weight"], own[f"mlp.experts.{i}.up_proj.weight"]]
            )
            for i in range(e)
        ]
    )
    block_sd["mlp.experts.down_proj"] = torch.stack(
        [own[f"mlp.experts.{i}.down_proj.weight"] for i in range(e)]
    )
    block.load_state_dict(block_sd, strict=True)
    parts["enorm"].weight.data.copy_(own["enorm.weight"])
    parts["hnorm"].weight.data.copy_(own["hnorm.weight"])
    parts["shared_head_norm"].weight.data.copy_(own["shared_head.norm.weight"])
    parts["eh_proj"].weight.data.copy_(own["eh_proj.weight"])
    return cfg, block.eval(), parts.eval()


def test_mtp_draft_logits_match_a_reference_from_transformers_parts(tiny_glm5: Path) -> None:
    """Slot i takes (h_i, t_{i+1}) at position i; then one more draft step recycles the
    MTP layer's own post-norm hidden state. fp32, 1e-5."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_glm5, dtype=torch.float32).eval()
    tensors = load_file(str(tiny_glm5 / "model.safetensors"))
    model, cfg = load_model(tiny_glm5, "float32", with_mtp=True)
    n_layers = cfg.num_hidden_layers
    c1, block, parts = _hf_mtp_reference(hf, tensors, n_layers)
    seq = torch.tensor(_prompts((2 * TOPK + 5,), seed=7)[0])
    n = len(seq)
    with torch.no_grad():
        h = hf.model(seq[None]).last_hidden_state[0]  # post-final-norm
        pos = torch.arange(n - 1)
        e = hf.model.embed_tokens(seq[1:]).masked_fill((pos == 0)[:, None], 0.0)
        x = parts["eh_proj"](torch.cat([parts["enorm"](e), parts["hnorm"](h[:-1])], -1))[None]
        # the cache argument: ``cache`` in transformers 5.24, ``past_key_values`` in 5.17
        names = inspect.signature(create_causal_mask).parameters
        key = "cache" if "cache" in names else "past_key_values"
        cache = {key: DynamicCache(config=c1)}
        mask = create_causal_mask(
            config=c1, inputs_embeds=x, attention_mask=None, position_ids=pos[None],
            allow_is_causal_skip=False, **cache,
        )  # fmt: skip
        out, _ = block(
            x,
            attention_mask=mask,
            position_embeddings=hf.model.rotary_emb(x, pos[None]),
            use_cache=True,
            **cache,
        )
        ref_h = parts["shared_head_norm"](out)[0]
        ref_logits = hf.lm_head(ref_h)
        # draft step 1 for the last slot: the draft token, the MTP's own hidden state
        draft = ref_logits[-1].argmax()
        e1 = hf.model.embed_tokens(draft[None])
        x1 = parts["eh_proj"](torch.cat([parts["enorm"](e1), parts["hnorm"](ref_h[-1:])], -1))[None]
        p1 = torch.tensor([[n - 1]])
        mask1 = create_causal_mask(
            config=c1, inputs_embeds=x1, attention_mask=None, position_ids=p1,
            allow_is_causal_skip=False, **cache,
        )  # fmt: skip
        out1, _ = block(
            x1,
            attention_mask=mask1,
            position_embeddings=hf.model.rotary_emb(x1, p1),
            use_cache=True,
            **cache,
        )
        ref1 = hf.lm_head(parts["shared_head_norm"](out1)[0])

        kv = PagedKV(model, 1, n + 8)
        with kv.step([0], [n]):
            target_h = model(seq, torch.arange(n))
        torch.testing.assert_close(target_h, h, rtol=1e-5, atol=1e-5)
        with kv.step([0], [n - 1]):
            logits, mtp_h = model.mtp_forward(seq[1:], pos, target_h[:-1])  # type: ignore[operator]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        with kv.step([n - 1], [1]):
            logits1, _ = model.mtp_forward(draft[None], torch.tensor([n - 1]), mtp_h[-1:], step=1)  # type: ignore[operator]
        torch.testing.assert_close(logits1, ref1, rtol=1e-5, atol=1e-5)


def _broken(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda t, c: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"), "model.layers.2.mlp.experts.5.up_proj.weight"),
        (lambda t, c: t.update({"model.layers.1.self_attn.indexer.wk.weight": torch.zeros(31, 256)}), "model.layers.1.self_attn.indexer.wk.weight"),
        (lambda t, c: c.update(index_topk_pattern="FSXF"), "index_topk_pattern"),
        (lambda t, c: c.update(n_group=3), "n_group"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_refused_naming_the_tensor_or_field(
    tiny_glm5: Path,
    tmp_path: Path,
    edit,
    needle: str,  # type: ignore[no-untyped-def]
) -> None:
    bad = _broken(tiny_glm5, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        load_model(bad, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLM"])
def test_uniform_decode_replays_graphs_on_cuda(arch: str, tiny_deepseek: dict[str, Path]) -> None:
    """MLA, the indexer and the MoE's capture path in full CUDA graphs: the same greedy
    tokens as the eager engine, and the decode steps on graphs."""
    path = str(tiny_deepseek[arch])
    prompts = _prompts((3 * TOPK, 2 * TOPK + 3, 5, 40))
    kw = dict(dtype="float32", block_size=16, device="cuda", max_model_len=256)
    eager = LLM(path, enforce_eager=True, **kw)  # type: ignore[arg-type]
    graphs = LLM(path, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}, **kw)  # type: ignore[arg-type]
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    assert graphs.engine.stats().step_paths.get("graph", 0) >= 8
