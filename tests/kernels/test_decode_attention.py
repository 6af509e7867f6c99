"""Parity of the split-K paged decode kernel with a plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from _paged import make_paged, tol

from pdserve.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_attention_reference,
    decode_workspace_numel,
)

CASES = [
    # (seq_lens, q_len, heads, kv_heads, head_dim, block_size, splits, dtype)
    ([37, 5, 64], 1, 4, 4, 16, 16, 1, torch.float32),  # MHA: broadcast path
    ([37, 1, 100], 1, 4, 1, 16, 16, 4, torch.float32),  # GQA 4, split-K
    ([150, 33], 1, 8, 1, 64, 32, 2, torch.bfloat16),  # GQA 8, D 64
    ([129, 70, 3], 2, 8, 2, 16, 64, 4, torch.float16),  # spec verify q_len 2
    ([90, 41], 4, 4, 1, 128, 16, 3, torch.bfloat16),  # q_len 4, D 128, odd splits
    ([17, 250], 1, 2, 2, 16, 16, 8, torch.float32),  # splits > tiles for a short request
]


@pytest.mark.parametrize("seq_lens,q_len,h,hkv,d,bs,splits,dtype", CASES)
def test_decode_matches_reference(
    device: torch.device,
    seq_lens: list[int],
    q_len: int,
    h: int,
    hkv: int,
    d: int,
    bs: int,
    splits: int,
    dtype: torch.dtype,
) -> None:
    pb = make_paged(seq_lens, [q_len] * len(seq_lens), hkv, d, bs, dtype, device)
    b = len(seq_lens)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b * q_len, h, d, generator=g).to(dtype).to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = d**-0.5
    out = decode_attention(q, pb.kv_cache, seq, pb.block_tables, scale, q_len, b, splits)
    ref = decode_attention_reference(q, pb.kv_cache, seq, pb.block_tables, scale, q_len, b)
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))


def test_padded_requests_and_rows(device: torch.device) -> None:
    """seq_len 0 requests output zeros; rows past B*q_len are not touched."""
    pb = make_paged([40, 9], [1, 1], 2, 16, 16, torch.float32, device)
    q = torch.randn(4, 4, 16, device=device)
    seq = torch.tensor([40, 0, 9], dtype=torch.int32, device=device)  # request 1 is padding
    bt = torch.cat(
        [pb.block_tables[:1], torch.zeros_like(pb.block_tables[:1]), pb.block_tables[1:]]
    )
    out = torch.full_like(q, 7.0)
    ws = torch.empty(decode_workspace_numel(3, 4, 16, 2), device=device)
    decode_attention(q, pb.kv_cache, seq, bt, 0.25, 1, 3, 2, out, ws)
    ref = decode_attention_reference(q, pb.kv_cache, seq, bt, 0.25, 1, 3)
    torch.testing.assert_close(out[:3], ref, **tol(torch.float32))
    assert torch.all(out[1] == 0)
    assert torch.all(out[3] == 7.0)


def test_split_count_is_static_and_bounded() -> None:
    assert choose_num_splits(1, 8, 16384, 132) == 64
    assert choose_num_splits(64, 8, 16384, 132) == 1
    assert choose_num_splits(1, 8, 1024, 132) == 16  # >= 64 tokens per split
    assert choose_num_splits(16, 8, 1024, 132) == 4
    for b in (1, 3, 16, 40, 256):
        s = choose_num_splits(b, 8, 1 << 17, 132)
        assert s & (s - 1) == 0 and b * 8 * s <= max(4 * 132, b * 8)


@pytest.mark.parametrize(
    "q_len,splits,dtype",
    [(1, 1, torch.bfloat16), (1, 4, torch.bfloat16), (4, 2, torch.bfloat16), (1, 4, torch.float16)],
)
def test_fp8_cache_with_16_bit_queries_takes_fp16_mmas(
    device: torch.device,
    q_len: int,
    splits: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over an fp8 cache, bf16 (and fp16) queries run fp16 MMAs (``FP8_HALF``): e4m3 ->
    fp16 is exact and fp16 keeps 3 more bits of q and p than bf16, so the output is as
    close to the float32 reference on the same fp8 cache as the MMAs in q's dtype
    (switched off here; the output's own rounding dominates both errors, hence the 1%
    margin). fp16 queries took fp16 MMAs before too: the conversion is what changed."""
    from pdserve.kernels import decode_attention as da
    from pdserve.kernels.reference import to_fp8

    seq_lens = [90, 41, 200]
    pb = make_paged(seq_lens, [q_len] * 3, 2, 128, 16, torch.float32, device)
    cache = to_fp8(pb.kv_cache * 4.0)  # values up to ~16: e4m3's coarse top binades
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(3 * q_len, 8, 128, generator=g) * 3).to(dtype).to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, cache, seq, pb.block_tables, 128**-0.5, q_len, 3)
    ref = decode_attention_reference(*args).float()
    ref32 = decode_attention_reference(q.float(), *args[1:]).float()  # fp32 output, no rounding
    half = decode_attention(*args, splits).float()
    monkeypatch.setattr(da, "FP8_HALF", False)
    plain = decode_attention(*args, splits).float()  # MMAs in q's dtype
    torch.testing.assert_close(half, ref, **tol(torch.bfloat16))
    torch.testing.assert_close(plain, ref, **tol(torch.bfloat16))
    if dtype == torch.bfloat16:
        assert not torch.equal(half, plain)  # the fp16 path ran
    assert (half - ref32).abs().mean() <= 1.01 * (plain - ref32).abs().mean()
