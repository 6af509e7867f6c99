"""Random and dummy GLM-5 weights are drawn in the order of the layers before q_a, the
indexer's wk and kv_a were merged into one GEMM, so a seed gives the values it gave
before (benchmarks compare trees on dummy weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.models.glm_moe_dsa import _unmerged_order
from pdserve.models.hf_config import load_hf_config
from pdserve.models.random_init import full_checkpoint_specs
from pdserve.testing.checkpoint import make_checkpoint


def test_merged_parts_are_drawn_where_their_layers_were(tmp_path: Path) -> None:
    make_checkpoint("GlmMoeDsaForCausalLM", "tiny", tmp_path, seed=0, config_only=True)
    names = list(full_checkpoint_specs(load_hf_config(tmp_path), torch.float32))
    attn = "model.layers.1.self_attn."
    i = names.index(attn + "q_a_proj.weight")
    assert names[i + 1 : i + 3] == [attn + "q_a_layernorm.weight", attn + "q_b_proj.weight"]
    assert names[i + 3] == attn + "kv_a_proj_with_mqa.weight"
    j = names.index(attn + "indexer.wq_b.weight")
    assert names[j + 1 : j + 3] == [attn + "indexer.wk.weight", attn + "indexer.k_norm.weight"]
    assert len(names) == len(set(names))


def test_unmerged_order_moves_every_tensor_of_a_part() -> None:
    p = "m.layers.0.self_attn."
    merged = [p + "q_a_proj.weight", p + "kv_a_proj_with_mqa.weight",
              p + "kv_a_proj_with_mqa.bias", p + "q_b_proj.weight", p + "q_b_proj.bias",
              p + "o_proj.weight"]  # fmt: skip
    assert _unmerged_order(merged) == [
        p + "q_a_proj.weight", p + "q_b_proj.weight", p + "q_b_proj.bias",
        p + "kv_a_proj_with_mqa.weight", p + "kv_a_proj_with_mqa.bias", p + "o_proj.weight",
    ]  # fmt: skip
