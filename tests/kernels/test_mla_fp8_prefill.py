"""A prefill over an fp8 latent cache through a 16-bit copy of the step's blocks
(``mla_triton.dequantized_blocks``), as the backend does for the Gluon kernels that read a
16-bit cache only: the same result as the kernel reading the fp8 cache."""

from __future__ import annotations

import pytest
import torch
from _sparse_batch import sparse_batch

from pdserve.kernels import sparse_mla_gluon
from pdserve.kernels.sparse_mla_prefill import candidate_rows, sparse_mla_prefill
from pdserve.layers.attention import mla_triton
from pdserve.layers.attention.mla_triton import MLATritonBackend, dequantized_blocks

PAGE = 4
FP8 = torch.float8_e4m3fn


def _batch(device: torch.device, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    sb = sparse_batch([90, 36, 60], [12, 36, 30], PAGE, g, device)
    t = sb.md.num_actual_tokens
    heads, lat, rope = 8, 32, 16
    cache = (4 * torch.randn(sb.num_blocks, PAGE, lat + rope, generator=g)).to(FP8).to(device)
    q_lat = torch.randn(t, heads, lat, generator=g).to(torch.bfloat16).to(device)
    q_pe = torch.randn(t, heads, rope, generator=g).to(torch.bfloat16).to(device)
    return sb, cache, q_lat, q_pe, sb.random_topk(40, g)


def _rows(sb, table: torch.Tensor, topk: torch.Tensor):  # type: ignore[no-untyped-def]
    md = sb.md
    return candidate_rows(table, md.seq_lens, md.query_start_loc, md.token_req_idx,
                          md.token_q_idx, topk, PAGE, md.num_actual_tokens)  # fmt: skip


def test_the_copy_of_the_blocks_gives_the_fp8_caches_result(device: torch.device) -> None:
    sb, cache, q_lat, q_pe, topk = _batch(device)
    t = sb.md.num_actual_tokens
    rows, ncand = _rows(sb, sb.md.block_tables, topk)
    want = sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, 0.3, t)
    copy, table = dequantized_blocks(cache, sb.md.block_tables, torch.bfloat16)
    assert copy.dtype == torch.bfloat16 and copy.shape[0] == sb.md.block_tables.numel()
    bt = sb.md.block_tables.long()
    assert torch.equal(copy[table.long()].float(), cache[bt].float())  # block for block
    rows2, ncand2 = _rows(sb, table, topk)
    assert torch.equal(ncand2, ncand)
    got = sparse_mla_prefill(q_lat, q_pe, copy, rows2, ncand2, 0.3, t)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_the_backend_hands_the_gluon_kernel_the_copy(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's wiring, with the Gluon kernel stood in for by the Triton one (which
    would refuse nothing): an fp8 cache reaches it as the 16-bit copy, under the kv scale;
    the output is the one of the Triton kernel over the fp8 cache."""
    sb, cache, q_lat, q_pe, topk = _batch(device)
    md, t = sb.md, sb.md.num_actual_tokens
    seen: list[torch.dtype] = []

    def gluon(q_lat, q_pe, keys, rows, ncand, scale, t, out, variant):  # type: ignore[no-untyped-def]
        seen.append(keys.dtype)
        sparse_mla_prefill(q_lat, q_pe, keys, rows, ncand, scale, t, out)

    monkeypatch.setattr(sparse_mla_gluon, "supported", lambda *a, **k: True)
    monkeypatch.setattr(sparse_mla_gluon, "sparse_mla_prefill_gluon", gluon)
    backend = MLATritonBackend(prefill_variant="gluon_ws", prefill_min_tokens=8)
    got = backend.forward(q_lat, q_pe, None, None, cache, md, 0.3, topk, kv_scale=0.5)
    assert seen == [torch.bfloat16]
    rows, ncand = _rows(sb, md.block_tables, topk)
    want = sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, 0.15, t) * 0.5
    torch.testing.assert_close(got[:t].float(), want.float(), atol=1e-2, rtol=1e-2)
    # past DEQUANT_MAX_ROWS the kernel reads the fp8 cache itself (the stand-in is not
    # asked: the Gluon kernels would refuse it)
    monkeypatch.setattr(mla_triton, "DEQUANT_MAX_ROWS", md.block_tables.numel() * PAGE - 1)
    monkeypatch.setattr(sparse_mla_gluon, "supported", lambda q, p, c, cache_dtype=None:
                        (cache_dtype or c.dtype) != FP8)  # fmt: skip
    again = backend.forward(q_lat, q_pe, None, None, cache, md, 0.3, topk, kv_scale=0.5)
    assert seen == [torch.bfloat16]
    torch.testing.assert_close(again[:t].float(), want.float(), atol=1e-2, rtol=1e-2)
