"""The prefill FLOP model (pdserve.profiling.prefill_flops) against a hand count of the tiny
GLM-5 preset: hidden 256, vocabulary 1024, 4 layers (layer 0 dense), 4 heads, q/kv LoRA
128/64, nope/rope/v 32/16/32, 8 experts of 128 (top-2) plus one shared, dense MLP 512,
indexer 16 heads x 32 in every layer, index_topk 16, an MTP layer (not counted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.models.hf_config import HFModelConfig
from pdserve.models.registry import get_model_class
from pdserve.profiling.prefill_flops import PrefillFlopModel
from pdserve.testing.checkpoint import make_checkpoint

H, V, Q_LORA, KV_LORA, NOPE, ROPE, VD, HEADS = 256, 1024, 128, 64, 32, 16, 32, 4
E, K, I_MOE, I_DENSE = 8, 2, 128, 512
IDX_HEADS, IDX_DIM, TOPK, LAYERS = 16, 32, 16, 4

# in * out of the linear layers that run as GEMMs on every token, per layer
ATTN = H * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + H * (KV_LORA + ROPE) + HEADS * VD * H
INDEXER = Q_LORA * IDX_HEADS * IDX_DIM + H * IDX_DIM + H * IDX_HEADS
DENSE = LAYERS * (ATTN + INDEXER) + 3 * H * I_DENSE + (LAYERS - 1) * 3 * H * I_MOE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> PrefillFlopModel:
    path = make_checkpoint("GlmMoeDsaForCausalLM", "tiny",
                           tmp_path_factory.mktemp("glm5-tiny-flops"), dtype="float32",
                           config_only=True)  # fmt: skip
    raw: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    hc = HFModelConfig.from_dict(raw)
    with torch.device("meta"):
        m = get_model_class(hc)(hc, torch.float32, with_mtp=True)
    return PrefillFlopModel.from_model(m)


def test_counts_follow_the_hand_count(model: PrefillFlopModel) -> None:
    assert (model.dense_weights, model.lm_head) == (DENSE, V * H)
    assert (model.attention_layers, model.indexer_layers, model.moe_layers) == (4, 4, 3)
    n = 40  # longer than index_topk: rows 0..15 read p + 1 keys, the other 24 read 16
    pairs = 16 * 17 // 2 + 24 * 16
    assert model.attended_pairs(n) == pairs
    f = model.flops(n)
    per_pair = 2 * HEADS * (KV_LORA + ROPE) + 2 * HEADS * KV_LORA
    absorbed = 2 * HEADS * (NOPE * KV_LORA + KV_LORA * VD)
    assert f["mla_attention"] == LAYERS * pairs * per_pair  # the sparse kernel's own
    assert f["indexer_score"] == LAYERS * (n * (n + 1) // 2) * 2 * IDX_HEADS * IDX_DIM
    assert f["moe_experts"] == 3 * 2 * n * K * 3 * H * I_MOE
    assert f["router"] == 3 * 2 * n * H * E
    assert f["dense_gemm"] == 2 * n * DENSE + 2 * V * H + LAYERS * n * absorbed  # + W_UK, W_UV
    assert f["total"] == sum(v for k, v in f.items() if k != "total")


def test_a_prompt_within_top_k_is_dense_and_not_scored(model: PrefillFlopModel) -> None:
    f = model.flops(TOPK)
    assert model.attended_pairs(TOPK) == TOPK * (TOPK + 1) // 2
    assert f["indexer_score"] == 0.0


def test_a_verify_step_counts_every_row(model: PrefillFlopModel) -> None:
    """Two requests of contexts 40 and 10, 3 rows each (positions 37-39 and 7-9): the
    long one's rows read top-k latents and score 38-40 keys, the short one's read 8-10
    and score none; every row runs the experts, the linear layers and the LM head."""
    f = model.step_flops([40, 10], rows_per_request=3)
    per_pair = 2 * HEADS * (KV_LORA + ROPE) + 2 * HEADS * KV_LORA
    absorbed = 2 * HEADS * (NOPE * KV_LORA + KV_LORA * VD)
    pairs = 3 * TOPK + (8 + 9 + 10)
    assert f["mla_attention"] == LAYERS * pairs * per_pair
    assert f["indexer_score"] == LAYERS * (38 + 39 + 40) * 2 * IDX_HEADS * IDX_DIM
    assert f["moe_experts"] == 3 * 2 * 6 * K * 3 * H * I_MOE
    assert f["router"] == 3 * 2 * 6 * H * E
    assert f["dense_gemm"] == 2 * 6 * (DENSE + V * H) + LAYERS * 6 * absorbed
    one = model.step_flops([40])  # plain decode: one row at position 39
    assert one["indexer_score"] == LAYERS * 40 * 2 * IDX_HEADS * IDX_DIM
