"""Block-FP8 weights under tensor parallelism, rank by rank (built and loaded as one
rank, no process group): each rank holds exactly its slice of the FP8 weights and of
their 128x128 block scales a single process holds, from an FP8 checkpoint, quantized at
load, or drawn (dummy); a split that would cut FP8 blocks is refused naming the layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.distributed import Group, ParallelGroups, RankInfo
from pdserve.kernels.reference import FP8_DTYPE, quantize_fp8_blocks
from pdserve.layers.fp8 import Fp8Linear
from pdserve.layers.fp8_parallel import (
    Fp8ColumnParallelLinear,
    Fp8MergedColumnParallelLinear,
    Fp8RowParallelLinear,
)
from pdserve.layers.linear import Shard, checkpoint_entries
from pdserve.layers.moe import RoutedExperts
from pdserve.models import load_model
from pdserve.models.loader import check_model_options


def _rank_groups(rank: int, size: int = 2) -> ParallelGroups:
    """A rank's groups for building and loading only (no process group: never run)."""
    info = RankInfo(tp_size=size, tp_rank=rank)
    return ParallelGroups(info=info, tp=Group(size=size, rank=rank, ranks=tuple(range(size))))


def _entries(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, Shard | None]]:
    own = getattr(model, "_entries", None)
    return own() if own is not None else checkpoint_entries(model)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _assert_rank_slices(full: torch.nn.Module, rank: torch.nn.Module) -> tuple[int, int]:
    """Every tensor of ``rank`` is its shard of ``full``'s, bit for bit; returns (FP8
    tensors sharded, scales sharded)."""
    whole = {n: t for n, (t, _) in _entries(full).items()}
    entries = _entries(rank)
    assert set(entries) == set(whole)
    fp8 = scales = 0
    for name, (t, shard) in entries.items():
        want = shard.of(whole[name]) if shard is not None else whole[name]
        assert t.dtype == want.dtype and torch.equal(_bits(t), _bits(want)), name
        if shard is not None:
            fp8 += t.dtype == FP8_DTYPE
            scales += name.endswith("weight_scale_inv")
    return fp8, scales


def test_llama_ranks_hold_their_fp8_blocks(tp_fp8_llama: tuple[Path, Path]) -> None:
    plain, fp8 = tp_fp8_llama
    full, _ = load_model(fp8, "float32")
    for r in range(2):
        for source, options in ((fp8, {}), (plain, {"quantization": "fp8"})):
            model, _ = load_model(source, "float32", groups=_rank_groups(r), **options)
            attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
            assert isinstance(attn.qkv_proj, Fp8MergedColumnParallelLinear)
            assert isinstance(mlp.down_proj, Fp8RowParallelLinear)
            assert attn.qkv_proj.weight.shape == (384, 256)  # q|k|v: 128 rows each a rank
            assert attn.qkv_proj.weight_scale_inv.shape == (3, 2)  # whole 128-row blocks
            assert mlp.down_proj.weight_scale_inv.shape == (2, 1)  # 128 of 256 columns
            fp8_sharded, scales = _assert_rank_slices(full, model)
            assert fp8_sharded == scales == 2 * 7  # q, k, v, o, gate, up, down per layer
    dummy_full, _ = load_model(fp8, "float32", load_format="dummy", seed=3)
    dummy_rank, _ = load_model(fp8, "float32", load_format="dummy", seed=3, groups=_rank_groups(1))
    _assert_rank_slices(dummy_full, dummy_rank)


def test_glm5_ranks_hold_their_fp8_blocks(tp_fp8_glm5: tuple[Path, Path]) -> None:
    """Heads, dense MLP, shared and routed experts split on block boundaries; kv_b_proj,
    dequantized at load, splits mid-block (224 rows a rank) and is read whole."""
    plain, fp8 = tp_fp8_glm5
    full, _ = load_model(fp8, "float32", with_mtp=True)
    for source, options in ((fp8, {}), (plain, {"quantization": "fp8"})):
        model, _ = load_model(source, "float32", with_mtp=True, groups=_rank_groups(1), **options)
        layer = model.model.layers[1]
        assert isinstance(layer.self_attn.q_b_proj, Fp8ColumnParallelLinear)
        assert layer.self_attn.kv_b_proj.weight.shape == (224, 64)  # dense, mid-block split
        assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
        experts = layer.mlp.experts
        assert experts.w13.dtype == FP8_DTYPE and experts.w13.shape == (8, 256, 256)
        assert experts.w13_scale_inv.shape == (8, 2, 2) and experts.w2_scale_inv.shape == (8, 2, 1)
        fp8_sharded, scales = _assert_rank_slices(full, model)
        assert fp8_sharded == scales > 4 * 8 * 3  # four MoE layers' experts (MTP's too)
    dummy_full, _ = load_model(fp8, "float32", load_format="dummy", seed=3)
    dummy_rank, _ = load_model(fp8, "float32", load_format="dummy", seed=3, groups=_rank_groups(0))
    _assert_rank_slices(dummy_full, dummy_rank)


def test_quantizing_a_slice_of_whole_blocks_is_slicing_the_quantized_weight() -> None:
    """Why splits must fall on 128 boundaries: then a rank quantizing its slice (load-time
    quantization) gets exactly the slice of the full weight's quantization."""
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_blocks(w, (128, 128))
    for dim, (a, b) in ((0, (256, 512)), (1, (128, 256))):
        qr, sr = quantize_fp8_blocks(w.narrow(dim, a, b - a), (128, 128))
        assert torch.equal(_bits(qr), _bits(q.narrow(dim, a, b - a)))
        assert torch.equal(sr, s.narrow(dim, a // 128, (b - a) // 128))
    q_off, _ = quantize_fp8_blocks(w[64:320], (128, 128))  # off the grid: other blocks
    assert not torch.equal(_bits(q_off), _bits(q[64:320]))


def test_splits_that_cut_fp8_blocks_are_refused(tiny_llama: Path, tiny_glm5: Path) -> None:
    """The tiny presets' heads are 64 rows: two ranks would hold half a block each."""
    want = (
        r"FP8 weights with --tensor-parallel-size 2: model\.layers\.0\.self_attn\.qkv_proj "
        r"splits the output features of q_proj \(64\) into 32 per rank, which is not a "
        r"multiple of the 128x128 weight-scale block"
    )
    with pytest.raises(ValueError, match=want):
        load_model(tiny_llama, "float32", quantization="fp8", groups=_rank_groups(0))
    with pytest.raises(ValueError, match=want):  # before any rank starts (meta device)
        check_model_options(tiny_llama, "fp8", groups=_rank_groups(0))
    with pytest.raises(ValueError, match=r"self_attn\.q_b_proj splits the output features \(192\)"):
        check_model_options(tiny_glm5, "fp8", groups=_rank_groups(0))
    check_model_options(tiny_llama, "fp8")  # one rank: any size


def test_experts_and_row_splits_that_cut_blocks_are_refused() -> None:
    tp = _rank_groups(1).tp
    experts = RoutedExperts(4, 128, 128, torch.float32, tp)  # 64 of 128 a rank
    want = r"model\.layers\.3\.mlp\.experts splits moe_intermediate_size \(128\) into 64 per rank"
    with pytest.raises(ValueError, match=want):
        experts.use_fp8(layer="model.layers.3.mlp.experts")
    with pytest.raises(ValueError, match=r"o_proj splits the input features \(384\) into 192"):
        Fp8RowParallelLinear(384, 128, tp=tp, layer="o_proj")
    with torch.device("meta"):
        ok = Fp8RowParallelLinear(512, 128, tp=tp, layer="o_proj")
    assert ok.weight.shape == (128, 256) and ok.weight_scale_inv.shape == (1, 2)
    assert isinstance(ok, Fp8Linear)
