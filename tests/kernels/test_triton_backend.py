"""End to end: the Triton backend matches TorchReferenceBackend on the same metadata."""

from __future__ import annotations

import pytest
import torch
from _paged import make_paged, tol

from pdserve.layers.attention import gqa_backend
from pdserve.layers.attention.backend import CommonAttentionMetadata
from pdserve.layers.attention.torch_ref import TorchReferenceBackend
from pdserve.layers.attention.triton_backend import (
    TritonAttentionBackend,
    TritonAttentionMetadata,
    uniform_query_len_of,
)

BATCHES = {
    "prompt": ([29], [29]),
    "prefill": ([21, 40], [21, 40]),
    "prefix_prefill": ([50, 33], [18, 33]),
    "decode": ([37, 90, 5], [1, 1, 1]),
    "verify_q3": ([37, 60], [3, 3]),
    "mixed": ([70, 12, 41], [1, 12, 1]),
}


def _run(
    backend: TritonAttentionBackend | TorchReferenceBackend,
    md: CommonAttentionMetadata,
    cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    return backend.forward(q, k, v, cache, backend.build_metadata(md), 0.25)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(
    "h,hkv,dtype", [(4, 4, torch.float32), (8, 2, torch.bfloat16), (8, 1, torch.float32)]
)
@pytest.mark.parametrize("sdpa", [False, True])
def test_triton_backend_matches_torch(
    device: torch.device, kind: str, h: int, hkv: int, dtype: torch.dtype, sdpa: bool
) -> None:
    seq_lens, q_lens = BATCHES[kind]
    d = 16
    pb = make_paged(seq_lens, q_lens, hkv, d, 16, dtype, device, seed=3)
    pad = 2
    md = pb.common(device, pad_to=sum(q_lens) + pad)
    t = md.num_actual_tokens
    g = torch.Generator().manual_seed(4)
    q = torch.randn(t + pad, h, d, generator=g).to(dtype).to(device)
    k = torch.randn(t + pad, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(t + pad, hkv, d, generator=g).to(dtype).to(device)
    tri_cache, ref_cache = pb.kv_cache.clone(), pb.kv_cache.clone()
    tri = TritonAttentionBackend(sdpa_prefill=sdpa)
    out = _run(tri, md, tri_cache, q, k, v)
    ref = _run(TorchReferenceBackend(), md, ref_cache, q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype))
    assert torch.all(out[t:] == 0)
    assert torch.equal(tri_cache, ref_cache)  # same layout, same contents


@pytest.mark.parametrize("sdpa", [False, True])
def test_lone_prompt_without_padding(device: torch.device, sdpa: bool) -> None:
    """One prompt and no padding rows: SDPA's output is returned as it is (no copy into
    a buffer), contiguous, equal to the reference, and the cache written as the
    reference writes it."""
    pb = make_paged([40], [40], 2, 16, 16, torch.bfloat16, device, seed=6)
    md = pb.common(device)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(40, h, 16, generator=g).to(device, torch.bfloat16) for h in (8, 2, 2))
    tri_cache, ref_cache = pb.kv_cache.clone(), pb.kv_cache.clone()
    out = _run(TritonAttentionBackend(sdpa_prefill=sdpa), md, tri_cache, q, k, v)
    ref = _run(TorchReferenceBackend(), md, ref_cache, q, k, v)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref.float(), **tol(torch.bfloat16))
    assert torch.equal(tri_cache, ref_cache)


def test_dispatch_uses_host_ints_only(device: torch.device) -> None:
    pb = make_paged([9, 9], [2, 2], 1, 16, 16, torch.float32, device)
    assert uniform_query_len_of(pb.common(device)) == 2
    pb = make_paged([9, 9], [2, 1], 1, 16, 16, torch.float32, device)
    assert uniform_query_len_of(pb.common(device)) is None
    pb = make_paged([30], [30], 1, 16, 16, torch.float32, device)
    assert uniform_query_len_of(pb.common(device)) is None  # a prompt, not a decode
    md = TritonAttentionBackend().build_metadata(pb.common(device))
    assert isinstance(md, TritonAttentionMetadata)


def test_graph_padded_decode_batch(device: torch.device) -> None:
    """A decode batch padded with seq_len-0 requests (the graph contract) gives the
    real requests' outputs and zeros for the padding, with split-K on."""
    h, hkv, d = 8, 2, 16
    seq_lens = [300, 45]
    pb = make_paged(seq_lens, [1, 1], hkv, d, 16, torch.float32, device)
    real = pb.common(device)
    width = pb.block_tables.shape[1]
    pad_bt = torch.cat([pb.block_tables, torch.zeros(2, width, dtype=torch.int32, device=device)])
    padded = CommonAttentionMetadata(
        num_reqs=4,
        num_actual_tokens=4,
        max_query_len=1,
        max_seq_len=300,
        block_size=16,
        query_start_loc=torch.arange(5, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + [0, 0], dtype=torch.int32, device=device),
        block_tables=pad_bt,
        slot_mapping=torch.cat([real.slot_mapping, real.slot_mapping.new_zeros(2)]),
        token_req_idx=torch.arange(4, device=device),
        token_q_idx=torch.zeros(4, dtype=torch.int64, device=device),
    )
    q = torch.randn(4, h, d, device=device)
    k = torch.randn(4, hkv, d, device=device)
    v = torch.randn(4, hkv, d, device=device)
    tri = TritonAttentionBackend(max_model_len=4096)
    tri.prepare_workspace(4, 1, h, hkv, d, device)
    c1, c2 = pb.kv_cache.clone(), pb.kv_cache.clone()
    out = _run(tri, padded, c1, q, k, v)
    ref = _run(TorchReferenceBackend(), real, c2, q[:2], k[:2], v[:2])
    torch.testing.assert_close(out[:2], ref, **tol(torch.float32))
    assert torch.all(out[2:] == 0)


def test_registry_builds_triton() -> None:
    assert isinstance(gqa_backend("triton"), TritonAttentionBackend)


@pytest.mark.gpu
def test_decode_captures_in_cuda_graph() -> None:
    """Capture one padded decode step (write + split-K attention + reduce), then
    replay it after changing only the device tensors' contents."""
    dev = torch.device("cuda")
    h, hkv, d, bs, nreq = 32, 8, 128, 16, 4
    pb = make_paged([1000, 300, 77, 5], [1] * nreq, hkv, d, bs, torch.bfloat16, dev, spare_blocks=8)
    md = pb.common(dev)
    q = torch.randn(nreq, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(nreq, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(nreq, hkv, d, device=dev, dtype=torch.bfloat16)
    tri = TritonAttentionBackend(max_model_len=4096)
    tri.prepare_workspace(nreq, 1, h, hkv, d, dev)
    tmd = tri.build_metadata(md)
    cache = pb.kv_cache
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.forward(q, k, v, cache, tmd, 0.1)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.forward(q, k, v, cache, tmd, 0.1)
    # new step: shorter contexts, new queries and K/V, same buffers
    md.seq_lens.copy_(torch.tensor([999, 200, 77, 1], dtype=torch.int32, device=dev))
    new_md = make_paged([999, 200, 77, 1], [1] * nreq, hkv, d, bs, torch.bfloat16, dev)
    new_md.block_tables = pb.block_tables
    md.slot_mapping.copy_(new_md.slots(dev))
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    graph.replay()
    ref_cache = cache.clone()
    ref_md = new_md.common(dev)
    ref = TorchReferenceBackend().forward(q, k, v, ref_cache, ref_md, 0.1)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), **tol(torch.bfloat16))
