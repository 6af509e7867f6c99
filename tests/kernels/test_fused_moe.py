"""Parity of the fused MoE kernels (expert alignment, grouped gate/up and down GEMMs, the
router's selection) with the model's torch reference paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_moe
from pdserve.kernels.fused_moe import align_by_expert, fused_experts, fused_experts_reference
from pdserve.kernels.moe_router import router_logits, router_select
from pdserve.layers.moe import experts_dense, experts_sorted, grouped_topk


def _routing(t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


def test_align_by_expert_groups_every_pair_once() -> None:
    g = torch.Generator().manual_seed(0)
    t, e, k, bm = 13, 8, 3, 4
    _, ids = _routing(t, e, k, g)
    ids[:, 0] = 5  # one crowded expert, several empty ones
    pairs, block_expert = align_by_expert(ids, e, bm)
    assert block_expert.shape[0] == -(-t * k // bm) + min(e, t * k)
    real = pairs[pairs < t * k]
    assert torch.equal(real.sort().values, torch.arange(t * k, dtype=torch.int32))
    flat = ids.flatten()
    for blk, ex in enumerate(block_expert.tolist()):
        chunk = pairs[blk * bm : (blk + 1) * bm]
        chunk = chunk[chunk < t * k].long()
        if ex < 0:
            assert chunk.numel() == 0
        else:
            assert chunk.numel() > 0 and bool((flat[chunk] == ex).all())


@pytest.mark.parametrize(
    "t,e,k,h,inter,dtype",
    [
        (1, 8, 2, 32, 16, torch.float32),  # one decode token
        (37, 16, 4, 48, 40, torch.float32),  # a prompt chunk; widths off the tiles
        (20, 8, 2, 64, 32, torch.bfloat16),
    ],
)
def test_fused_experts_match_reference(
    device: torch.device, t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(dtype).to(device)
    weights, ids = (a.to(device) for a in _routing(t, e, k, g))
    out = fused_experts(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:  # the model's eager and graph paths
        for ref in (experts_sorted, experts_dense):
            torch.testing.assert_close(out, ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    else:  # float32 math reference; bf16 rounding of the intermediate and output
        ref = fused_experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("group_m", [1, 3])
def test_fused_experts_grouped_program_order_is_the_same_product(
    device: torch.device, group_m: int
) -> None:
    """``group_m`` only reorders the programs (row blocks sweep column tiles together):
    the same values as the default order, bit for bit, with a group that does not divide
    the row blocks and several column tiles."""
    g = torch.Generator().manual_seed(3)
    t, e, k, h, inter = 29, 4, 2, 48, 40
    x = torch.randn(t, h, generator=g).to(device)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(device)
    weights, ids = (a.to(device) for a in _routing(t, e, k, g))
    base = fused_moe.MoeConfig(16, 16, 16, 4)
    want = fused_experts(x, w13, w2, weights, ids, config=base)
    got = fused_experts(x, w13, w2, weights, ids, config=base._replace(group_m=group_m))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got, experts_sorted(x, w13, w2, weights, ids), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    chunked = base._replace(group_m=group_m, chunk_tokens=8)  # 4 launch pairs, the last short
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=chunked), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    wide = base._replace(group_m=group_m, down_n=32)  # the down GEMM's own column tile
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, config=wide), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_fused_experts_chunks_long_batches(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_moe, "CHUNK_TOKENS", 8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 32, generator=g).to(device)
    w13 = torch.randn(4, 32, 32, generator=g).to(device) / 6
    w2 = torch.randn(4, 32, 16, generator=g).to(device) / 4
    weights, ids = (a.to(device) for a in _routing(19, 4, 2, g))
    torch.testing.assert_close(
        fused_experts(x, w13, w2, weights, ids),
        experts_sorted(x, w13, w2, weights, ids),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "t,e,k,n_group,topk_group,norm",
    [(1, 8, 2, 1, 1, True), (37, 16, 4, 4, 2, True), (20, 64, 8, 8, 4, False)],
)
def test_router_select_matches_grouped_topk(
    device: torch.device, t: int, e: int, k: int, n_group: int, topk_group: int, norm: bool
) -> None:
    g = torch.Generator().manual_seed(e)
    x = torch.randn(t, 32, generator=g).to(device)
    w = (torch.randn(e, 32, generator=g) * 0.5).to(device)
    bias = (torch.randn(e, generator=g) * 0.1).to(device)
    got_w, got_ids = router_select(F.linear(x, w), bias, k, n_group, topk_group, norm, 2.5)
    ref_w, ref_ids = grouped_topk(x, w, bias, k, n_group, topk_group, norm, 2.5)
    ours, o1 = got_ids.sort(dim=-1)
    theirs, o2 = ref_ids.sort(dim=-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(got_w.gather(1, o1), ref_w.gather(1, o2), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("t,e,h", [(70, 16, 96), (5, 64, 200)])
def test_router_logits_match_the_float32_gemm(device: torch.device, t: int, e: int, h: int) -> None:
    """bf16 tokens times a float32 weight (magnitudes over six decades) through three
    bf16 parts of the weight: the float32 GEMM's logits within float32 rounding."""
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(e, h, generator=g) * 10 ** (6 * torch.rand(e, h, generator=g) - 5)
    w = w.to(device)
    got = router_logits(x, w)
    want = F.linear(x.double(), w.double())
    scale = (x.double().abs() @ w.double().abs().t()).max()
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max() / scale) < 1e-6
    # one bf16 copy of the weight alone is far off: the parts are what makes it float32
    one = F.linear(x.double(), w.to(torch.bfloat16).double())
    assert float((one - want).abs().max() / scale) > 1e-4


def test_router_takes_the_split_weight_gemm_from_a_prefill_batch(device: torch.device) -> None:
    """TopKRouter on a bf16 batch of ROUTER_GEMM_MIN_TOKENS tokens (the router_logits
    path) routes as grouped_topk on the same tokens in float32."""
    from pdserve.kernels.moe_router import ROUTER_GEMM_MIN_TOKENS
    from pdserve.layers.moe import TopKRouter

    g = torch.Generator().manual_seed(9)
    t, e, h = ROUTER_GEMM_MIN_TOKENS, 16, 32
    router = TopKRouter(h, e, 4, 4, 2, True, 2.5).to(device)
    router.fused = True
    router.weight.data.copy_(torch.randn(e, h, generator=g) * 0.3)
    router.e_score_correction_bias.data.copy_(torch.randn(e, generator=g) * 0.1)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    got_w, got_ids = router(x)
    ref_w, ref_ids = grouped_topk(x, router.weight, router.e_score_correction_bias, 4, 4, 2,
                                  True, 2.5)  # fmt: skip
    ours, o1 = got_ids.sort(dim=-1)
    theirs, o2 = ref_ids.sort(dim=-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(got_w.gather(1, o1), ref_w.gather(1, o2), atol=1e-5, rtol=1e-5)


def test_default_tiles_fit_shared_memory_for_float32_operands() -> None:
    """The 16-bit defaults stay as they are; for 4-byte operands (float32 models, as the
    engine GPU tests run) the prefill tiles drop a pipeline stage so the operand ring
    fits (run 102 on an H100: 294,912 bytes asked of 232,448)."""
    from pdserve.kernels.fused_moe import SHARED_BUDGET, _config, fit_shared, ring_bytes

    assert ring_bytes(_config(65536, 64), 4) == 294_912  # what Triton asked for
    for pairs in (64, 1024, 4096, 8192, 65536):
        cfg = _config(pairs, 64)
        assert fit_shared(cfg, 2) == cfg
        f32 = fit_shared(cfg, 4)
        assert ring_bytes(f32, 4) <= SHARED_BUDGET
        assert f32.block_m == cfg.block_m and f32.block_n == cfg.block_n
    assert fit_shared(_config(65536, 64), 4).stages == 3
