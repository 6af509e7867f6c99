"""The Gluon sparse MLA prefill kernel (kernels/sparse_mla_gluon.py): parity with the torch
reference on a Hopper GPU (Gluon has no CPU interpreter; tools/sm90_report.py compiles it
for sm_90a in the CPU suite), and on any machine what it refuses and the MLA backend's
fallback to the Triton kernel where it does not apply."""

from __future__ import annotations

import pytest
import torch
from _sparse_batch import sparse_batch

from pdserve.kernels import sparse_mla_gluon, sparse_mla_gluon_ws
from pdserve.kernels.sparse_mla import sparse_mla_reference
from pdserve.kernels.sparse_mla_prefill import DEFAULT_VARIANT, candidate_rows, sparse_mla_prefill

PAGE = 16

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel is for Hopper (sm_90)",
)


def _batch(device: torch.device, heads: int, lat: int, rope: int, dtype: torch.dtype,
           seed: int, k: int = 150):  # fmt: skip
    """Rows beyond a top-k of ``k`` (3 tiles of 64, the last partial, with holes), rows
    within it (dense causal: up to 2 tiles), a cached prefix, and a 1-row verify."""
    g = torch.Generator().manual_seed(seed)
    sb = sparse_batch([330, 120, 9], [40, 24, 1], PAGE, g, device)
    t = sb.md.num_actual_tokens
    cache = torch.randn(sb.num_blocks, PAGE, lat + rope, generator=g).to(dtype).to(device)
    q_lat = torch.randn(t, heads, lat, generator=g).to(dtype).to(device)
    q_pe = torch.randn(t, heads, rope, generator=g).to(dtype).to(device)
    topk = sb.random_topk(k, g)
    topk[0, 3] = -1
    topk[1, 70:90] = -1  # a run of holes across a tile boundary
    md = sb.md
    rows, ncand = candidate_rows(md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.token_req_idx, md.token_q_idx, topk, PAGE, t)  # fmt: skip
    return sb, cache, q_lat, q_pe, topk, rows, ncand


@hopper
@pytest.mark.parametrize("variant", sorted(sparse_mla_gluon.VARIANTS))
@pytest.mark.parametrize("heads,lat,rope,dtype", [(64, 512, 64, torch.bfloat16),
                                                  (20, 128, 64, torch.bfloat16),
                                                  (128, 64, 16, torch.float16)])  # fmt: skip
def test_gluon_prefill_matches_reference(
    variant: str, heads: int, lat: int, rope: int, dtype: torch.dtype
) -> None:
    """GLM-5's widths, a head count short of the 64-head block (zero head slots, never
    stored) and two head blocks; a scale at which running maxima grow past the lazy
    variant's threshold too."""
    dev = torch.device("cuda")
    sb, cache, q_lat, q_pe, topk, rows, ncand = _batch(dev, heads, lat, rope, dtype, heads)
    t = sb.md.num_actual_tokens
    assert sparse_mla_gluon.supported(q_lat, q_pe, cache)
    for scale in (0.05, 0.5):
        out = torch.full_like(q_lat, float("nan"))
        out = sparse_mla_gluon.sparse_mla_prefill_gluon(q_lat, q_pe, cache, rows, ncand, scale,
                                                        t, out, variant)  # fmt: skip
        ref = sparse_mla_reference(q_lat, q_pe, cache, sb.md.block_tables, sb.positions,
                                   sb.req, topk, scale)  # fmt: skip
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        triton_out = sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, scale, t)
        torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


@hopper
@pytest.mark.parametrize("variant", ["gluon", "gluon_ws"])
def test_gluon_prefill_rows_without_candidates_are_zero(variant: str) -> None:
    dev = torch.device("cuda")
    sb, cache, q_lat, q_pe, _, rows, ncand = _batch(dev, 64, 512, 64, torch.bfloat16, 1)
    ncand[:5] = 0
    out = sparse_mla_gluon.sparse_mla_prefill_gluon(q_lat, q_pe, cache, rows, ncand, 0.1,
                                                    sb.md.num_actual_tokens, variant=variant)  # fmt: skip
    assert torch.count_nonzero(out[:5]) == 0 and torch.isfinite(out).all()


def test_gluon_prefill_refuses_what_it_does_not_run(device: torch.device) -> None:
    """Off Hopper, in float32, with an 8-bit cache or widths its tiles do not take,
    ``supported`` is false and the entry point refuses; an unknown variant is refused."""
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16, device=device)
    pe = torch.zeros(4, 64, 64, dtype=torch.bfloat16, device=device)
    cache = torch.zeros(3, PAGE, 576, dtype=torch.bfloat16, device=device)
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    assert sparse_mla_gluon.supported(q, pe, cache) == on_hopper
    assert not sparse_mla_gluon.supported(q.float(), pe.float(), cache.float())
    assert not sparse_mla_gluon.supported(q[..., :48], pe, cache[..., :112])
    # the warp-specialized kernel: GLM-5's widths; not a rope width other than its 64 keys
    assert sparse_mla_gluon_ws.supported(q, pe, cache) == on_hopper
    assert not sparse_mla_gluon_ws.supported(q, pe[..., :16], cache[..., :528])
    if hasattr(torch, "float8_e4m3fn"):
        assert not sparse_mla_gluon.supported(q, pe, cache.to(torch.float8_e4m3fn))
    rows = torch.zeros(4, 8, dtype=torch.int32, device=device)
    ncand = torch.zeros(4, dtype=torch.int32, device=device)
    if not on_hopper:
        with pytest.raises(ValueError, match="sm_90"):
            sparse_mla_gluon.sparse_mla_prefill_gluon(q, pe, cache, rows, ncand, 0.1, 4)
    with pytest.raises(ValueError, match="variant"):
        sparse_mla_gluon.sparse_mla_prefill_gluon(q, pe, cache, rows, ncand, 0.1, 4,
                                                  variant="nope")  # fmt: skip


def test_backend_runs_the_triton_kernel_where_gluon_does_not_apply(device: torch.device) -> None:
    """``prefill_variant="gluon"`` on a machine or operands the Gluon kernel does not take
    (here float32) gives the default Triton variant's output, not an error."""
    from pdserve.layers.attention.mla_triton import MLATritonBackend

    dtype = torch.float32
    sb, cache, q_lat, q_pe, topk, rows, ncand = _batch(device, 8, 64, 16, dtype, 7, k=40)
    md, t = sb.md, sb.md.num_actual_tokens
    backend = MLATritonBackend(prefill_variant="gluon", prefill_min_tokens=8)
    got = backend.forward(q_lat, q_pe, None, None, cache, md, 0.3, topk)
    want = sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, 0.3, t, variant=DEFAULT_VARIANT)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="prefill_variant"):
        MLATritonBackend(prefill_variant="gluon_fast")


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=hopper)],  # bf16: Gluon
)
def test_backend_takes_the_rows_kernel_for_large_decode_steps(
    device: torch.device, dtype: torch.dtype
) -> None:
    """With ``rows_min_tokens`` set, a decode-shaped step (one row a request) of that many
    rows runs candidate rows + the prefill kernel (on Hopper in bf16: the Gluon kernel,
    the default): the general kernel's output."""
    from pdserve.layers.attention.mla_triton import MLATritonBackend

    g = torch.Generator().manual_seed(11)
    sb = sparse_batch([70, 50, 9, 64], [1, 1, 1, 1], PAGE, g, device)
    cache = torch.randn(sb.num_blocks, PAGE, 64 + 16, generator=g).to(device, dtype)
    t = sb.md.num_actual_tokens
    q_lat = torch.randn(t, 8, 64, generator=g).to(device, dtype)
    q_pe = torch.randn(t, 8, 16, generator=g).to(device, dtype)
    topk = sb.random_topk(40, g)
    general = MLATritonBackend(prefill_variant=None)
    want = general.forward(q_lat, q_pe, None, None, cache, sb.md, 0.3, topk)
    rows = MLATritonBackend(rows_min_tokens=4)
    got = rows.forward(q_lat, q_pe, None, None, cache, sb.md, 0.3, topk)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if dtype != torch.float32:
        return
    # below the threshold: the general kernel itself
    few = MLATritonBackend(rows_min_tokens=5).forward(q_lat, q_pe, None, None, cache, sb.md,
                                                      0.3, topk)  # fmt: skip
    torch.testing.assert_close(few, want, atol=0, rtol=0)
