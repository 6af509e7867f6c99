"""The decode byte model (pdserve.profiling.decode_roofline) against a hand count of the tiny
GLM-5 preset, float32 (4 bytes a value): hidden 256, vocabulary 1024, 4 layers (layer 0
dense), 4 heads, q/kv LoRA 128/64, nope/rope/v 32/16/32, 8 experts of 128 (top-2) plus
one shared, dense MLP 512, indexer 16 heads x 32, index_topk 16, an MTP layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.models.hf_config import HFModelConfig
from pdserve.models.registry import get_model_class
from pdserve.profiling.decode_roofline import DecodeByteModel, layer_index
from pdserve.runner.model_step import collect_cache_layers
from pdserve.testing.checkpoint import make_checkpoint

F32 = 4
H, V, Q_LORA, KV_LORA, NOPE, ROPE, VD, HEADS = 256, 1024, 128, 64, 32, 16, 32, 4
E, K, I_MOE, I_DENSE = 8, 2, 128, 512
IDX_HEADS, IDX_DIM, TOPK = 16, 32, 16

ATTN = (
    2 * H  # input / post-attention norms
    + H * Q_LORA  # q_a_proj
    + Q_LORA  # q_a_layernorm
    + Q_LORA * HEADS * (NOPE + ROPE)  # q_b_proj
    + H * (KV_LORA + ROPE)  # kv_a_proj_with_mqa
    + KV_LORA  # kv_a_layernorm
    + KV_LORA * HEADS * (NOPE + VD)  # kv_b_proj
    + HEADS * VD * H  # o_proj
)
INDEXER = Q_LORA * IDX_HEADS * IDX_DIM + H * IDX_DIM + 2 * IDX_DIM + H * IDX_HEADS
DENSE_MLP = 3 * H * I_DENSE
MOE_FIXED = E * H + E + 3 * H * I_MOE  # router (weight, bias), shared expert
EXPERT = 3 * H * I_MOE * F32  # one routed expert: gate, up, down
LATENT_ROW = (KV_LORA + ROPE) * F32
INDEX_KEY = IDX_DIM * F32


@pytest.fixture(scope="module")
def raw_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = make_checkpoint(
        "GlmMoeDsaForCausalLM",
        "tiny",
        tmp_path_factory.mktemp("glm5-tiny-config"),
        dtype="float32",
        config_only=True,
    )
    return json.loads((Path(path) / "config.json").read_text())


def _byte_model(raw: dict[str, Any], fp8_latent: bool = False, **over: Any) -> DecodeByteModel:
    hc = HFModelConfig.from_dict({**raw, **over})
    with torch.device("meta"):  # shapes only, nothing allocated
        model = get_model_class(hc)(hc, torch.float32, with_mtp=True)  # MTP built, not counted
    fp8 = "float8_e4m3fn" if fp8_latent else None
    cache, _ = collect_cache_layers(model, 16, "float32", fp8)
    return DecodeByteModel.from_model(model, cache)


def test_layer_index() -> None:
    assert layer_index("model.layers.12.mlp.experts.w13") == 12
    assert layer_index("model.layers.3") == 3
    assert layer_index("lm_head.weight") is None


def test_step_bytes_match_a_hand_count(raw_config: dict[str, Any]) -> None:
    bm = _byte_model(raw_config)
    dense_params = 4 * (ATTN + INDEXER) + DENSE_MLP + 3 * MOE_FIXED + H + V * H  # + norm, head
    assert bm.dense_weight_bytes == dense_params * F32
    assert bm.expert_bytes == (EXPERT,) * 3  # the MTP layer's experts are not the target's
    assert bm.embed_row_bytes == H * F32
    # one context within index_topk (attended whole, nothing scored), one beyond it
    got = bm.step_bytes([10, 40], active_experts=[3, 2, 4])
    assert got["weights"] == dense_params * F32 + 2 * H * F32
    assert got["experts"] == (3 + 2 + 4) * EXPERT
    assert got["latents"] == 4 * (10 + TOPK) * LATENT_ROW
    assert got["index_keys"] == 4 * 40 * INDEX_KEY
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    # uniform routing of 2 tokens: 8 * (1 - (6/8)^2) = 3.5 experts a layer
    assert bm.expected_active_experts(2) == pytest.approx(3.5)
    uniform = bm.step_bytes([10, 40])
    assert uniform["experts"] == pytest.approx(3 * 3.5 * EXPERT)
    with pytest.raises(ValueError, match="2 layers, not 3"):
        bm.step_bytes([10], active_experts=[1, 1])


def test_verify_rows_read_their_own_latents(raw_config: dict[str, Any]) -> None:
    """A verify step of 1 + 3 rows a request: latents once a row, weights once a step,
    indexer keys once a request, experts as 4 times the tokens reach them."""
    bm = _byte_model(raw_config)
    one = bm.step_bytes([10, 40], active_experts=[3, 2, 4])
    four = bm.step_bytes([10, 40], active_experts=[3, 2, 4], rows_per_request=4)
    assert four["latents"] == 4 * one["latents"]
    for part in ("weights", "experts", "index_keys"):
        assert four[part] == one[part]
    assert bm.step_bytes([10, 40], rows_per_request=4)["experts"] == pytest.approx(
        3 * bm.expected_active_experts(8) * EXPERT
    )


def test_index_sharing_layers_read_no_indexer_keys(raw_config: dict[str, Any]) -> None:
    """GLM-5.2 style F, S, F, S: two layers run an indexer (weights and keys), all four
    attend to their top-k latents."""
    bm = _byte_model(raw_config, index_topk_freq=2, index_skip_topk_offset=1)
    dense_params = 4 * ATTN + 2 * INDEXER + DENSE_MLP + 3 * MOE_FIXED + H + V * H
    assert bm.dense_weight_bytes == dense_params * F32
    got = bm.step_bytes([40], active_experts=[2, 2, 2])
    assert got["index_keys"] == 2 * 40 * INDEX_KEY
    assert got["latents"] == 4 * TOPK * LATENT_ROW


def test_fp8_cache_counts_one_byte_a_value(raw_config: dict[str, Any]) -> None:
    bm = _byte_model(raw_config, fp8_latent=True)
    got = bm.step_bytes([40], active_experts=[2, 2, 2])
    assert got["latents"] == 4 * TOPK * (KV_LORA + ROPE)  # float8 latents
    # float8 indexer keys, each with its float32 scale
    assert got["index_keys"] == 4 * 40 * (IDX_DIM + 4)
