"""Parity of the varlen paged prefill kernel (and the SDPA path) with plain torch."""

from __future__ import annotations

import pytest
import torch
from _paged import make_paged, tol

from pdserve.kernels.prefill_attention import (
    prefill_attention,
    prefill_attention_reference,
    sdpa_bucket,
    sdpa_prefill,
)

CASES = [
    # (seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype)
    ([23], [23], 2, 2, 16, 16, torch.float32),  # one prompt, no prefix, MHA
    ([70, 33, 5], [30, 33, 1], 4, 1, 16, 16, torch.float32),  # prefix + prompt + decode, GQA 4
    ([100, 9, 64], [1, 9, 17], 8, 1, 64, 32, torch.bfloat16),  # GQA 8, non-multiple lengths
    ([130, 20], [40, 1], 8, 2, 128, 64, torch.float16),  # D 128, block 64
    ([45, 45, 3], [2, 1, 3], 6, 2, 16, 16, torch.bfloat16),  # group 3 (non power of two)
]


@pytest.mark.parametrize("seq_lens,q_lens,h,hkv,d,bs,dtype", CASES)
def test_prefill_matches_reference(
    device: torch.device,
    seq_lens: list[int],
    q_lens: list[int],
    h: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
) -> None:
    pb = make_paged(seq_lens, q_lens, hkv, d, bs, dtype, device)
    md = pb.common(device)
    t = md.num_actual_tokens
    g = torch.Generator().manual_seed(2)
    q = torch.randn(t + 3, h, d, generator=g).to(dtype).to(device)  # 3 padded rows
    out = torch.full_like(q, 5.0)
    prefill_attention(
        q,
        pb.kv_cache,
        md.query_start_loc,
        md.seq_lens,
        md.block_tables,
        d**-0.5,
        md.num_reqs,
        t,
        md.max_query_len,
        out,
    )
    ref = prefill_attention_reference(
        q, pb.kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, d**-0.5, md.num_reqs
    )
    torch.testing.assert_close(out[:t].float(), ref.float(), **tol(dtype))
    assert torch.all(out[t:] == 5.0)  # padded rows untouched


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "cudnn_gqa"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 1)])
def test_sdpa_prefill_matches_reference(
    device: torch.device, h: int, hkv: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either order; under "cudnn" the 37 rows are padded to 128 (on the CPU the math
    kernel runs them), and the K/V heads shared by enable_gqa."""
    n, d = 37, 16
    pb = make_paged([n], [n], hkv, d, 16, torch.float32, device)
    md = pb.common(device)
    # the SDPA path reads this step's K/V: take them from the cache the kernel reads
    slots = md.slot_mapping
    k = pb.kv_cache[0].reshape(-1, hkv, d)[slots]
    v = pb.kv_cache[1].reshape(-1, hkv, d)[slots]
    q = torch.randn(n, h, d, device=device)
    monkeypatch.setenv("PDSERVE_SDPA_PREFILL", kernel)
    out = sdpa_prefill(q, k, v, 0.3)
    assert out.shape == q.shape
    ref = prefill_attention_reference(
        q, pb.kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.3, 1
    )
    torch.testing.assert_close(out, ref, **tol(torch.float32))


def test_sdpa_bucket() -> None:
    assert [sdpa_bucket(n) for n in (1, 128, 129, 1000, 1025, 8000, 8192, 8193)] == [
        128, 128, 256, 1024, 1152, 8192, 8192, 9216,
    ]


def test_sdpa_prefill_refuses_unknown_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_SDPA_PREFILL", "fa3")
    with pytest.raises(ValueError, match="PDSERVE_SDPA_PREFILL"):
        sdpa_prefill(*(torch.zeros(4, 2, 8) for _ in range(3)), 1.0)


def test_warm_sdpa_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call per shape at each bucket up to the budget's under cuDNN; none under flash."""
    from pdserve.kernels import prefill_attention as pa

    lens: list[int] = []
    monkeypatch.setattr(pa, "sdpa_prefill", lambda q, *a: lens.append(q.shape[0]))
    shapes, cpu = {(4, 2, 8), (4, 4, 8)}, torch.device("cpu")
    monkeypatch.setenv("PDSERVE_SDPA_PREFILL", "flash")
    assert pa.warm_sdpa_plans(shapes, 1000, torch.float32, cpu) == 0
    monkeypatch.delenv("PDSERVE_SDPA_PREFILL")  # the default: cudnn_gqa
    assert pa.warm_sdpa_plans(shapes, 1000, torch.float32, cpu) == 16
    assert lens == [128 * i for i in range(1, 9)] * 2
