"""Shared layers against their textbook / transformers definitions."""

from __future__ import annotations

import pytest
import torch

from pdserve.layers.activation import SiluAndMul
from pdserve.layers.linear import Linear, MergedLinear, checkpoint_targets, copy_checked
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RopeScaling, RotaryEmbedding, apply_rotary, rope_inv_freq

LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_llama3_inv_freq_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(16, 500000.0, LLAMA3)
    assert torch.equal(ours, ref)
    plain = rope_inv_freq(16, 500000.0, None)
    assert (ours < plain).any() and (ours == plain).any()  # the tiny preset hits every band


def test_rotary_matches_rotate_half() -> None:
    rope = RotaryEmbedding(16, 128, 10000.0, LLAMA3)
    positions = torch.tensor([0, 5, 127, 3])
    x = torch.randn(4, 3, 16)
    cos, sin = rope(positions)
    inv = rope_inv_freq(16, 10000.0, LLAMA3)
    emb = torch.cat([positions[:, None].float() * inv] * 2, dim=-1)[:, None, :]
    rotated_half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    ref = x * emb.cos() + rotated_half * emb.sin()
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref, rtol=0, atol=1e-6)
    assert torch.equal(apply_rotary(x, *rope(torch.zeros(4, dtype=torch.long))), x)


def test_rmsnorm_fused_residual() -> None:
    norm = RMSNorm(8, 1e-6)
    norm.weight.data.normal_()
    x, r = torch.randn(5, 8), torch.randn(5, 8)
    ref = norm.weight * (x + r) / ((x + r).pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    out, residual = norm(x, r)
    torch.testing.assert_close(out, ref)
    assert torch.equal(residual, x + r)
    torch.testing.assert_close(norm(x + r), ref)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_merged_linear_routes_hf_names() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = MergedLinear(4, {"q_proj": 4, "k_proj": 2, "v_proj": 2}, bias=True)
            self.o_proj = Linear(4, 4)

    block = Block()
    targets = checkpoint_targets(block)
    assert set(targets) == {
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
        "v_proj.weight", "v_proj.bias", "o_proj.weight",
    }  # fmt: skip
    q, k, v = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)
    for name, t in (("q_proj.weight", q), ("k_proj.weight", k), ("v_proj.weight", v)):
        copy_checked(targets[name], t, name)
    assert torch.equal(block.qkv_proj.weight, torch.cat([q, k, v]))
    with pytest.raises(ValueError, match="k_proj.weight"):
        copy_checked(targets["k_proj.weight"], torch.randn(3, 4), "k_proj.weight")
