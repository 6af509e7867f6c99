"""Block-FP8 GEMM and the FP8 KV cache: the Triton kernels against the torch references.

Tolerances: the GEMM kernel quantizes activations as the reference does, so the two
agree to float32 accumulation order plus the interpreter's fp8 rounding of exact ties
(it rounds half up, torch half to even): 1e-2 of the output's largest magnitude. The
FP8 attention paths read the same fp8 cache bytes the reference dequantizes, so they
match it to the usual float32 attention tolerance.
"""

from __future__ import annotations

import pytest
import torch
from _paged import make_paged, tol

from pdserve.kernels.fp8_gemm import (
    Fp8GemmConfig,
    block_fp8_gemm,
    choose_splits,
    resolve_fp8_gemm_config,
)
from pdserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from pdserve.kernels.reference import (
    FP8_DTYPE,
    block_fp8_matmul_reference,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from pdserve.layers.attention.backend import CommonAttentionMetadata
from pdserve.layers.attention.torch_ref import TorchReferenceBackend
from pdserve.layers.attention.triton_backend import TritonAttentionBackend


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_block_quantization_round_trip_and_layout() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * torch.linspace(0.01, 10, 300)
    q, s = quantize_fp8_blocks(w, (128, 128))
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.shape == (2, 3) and s.dtype == torch.float32  # partial edge blocks included
    back = dequantize_fp8_blocks(q, s, (128, 128))
    # e4m3 keeps 3 mantissa bits: at most 1/16 relative error per value, plus the
    # subnormal floor of each block (its scale times 2^-9)
    floor = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300] * 2**-9
    assert bool(((back - w).abs() <= w.abs() / 16 + floor).all())
    xq, xs = quantize_fp8_groups(w[:5])
    assert xs.shape == (5, 3)
    assert _rel(dequantize_fp8_blocks(xq, xs, (1, 128)), w[:5]) < 0.07


@pytest.mark.parametrize(
    "m,n,k,scale_rows,splits",
    [(1, 192, 256, 128, None), (5, 130, 200, 1, 2), (37, 64, 384, 128, 3), (70, 96, 128, 1, None)],
)
def test_block_fp8_gemm_matches_reference(
    device: torch.device, m: int, n: int, k: int, scale_rows: int, splits: int | None
) -> None:
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g) * 0.05
    wq, ws = quantize_fp8_blocks(w, (scale_rows, 128))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) if m == 5 else None
    wq, ws, x = wq.to(device), ws.to(device), x.to(device)
    bias = bias.to(device) if bias is not None else None
    ref = block_fp8_matmul_reference(x, wq, ws, bias, scale_rows=scale_rows)
    out = block_fp8_gemm(x, wq, ws, scale_rows, bias, num_splits=splits)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert _rel(out, ref) < 1e-2
    # the reference itself is the plain matmul within activation + weight quantization
    assert _rel(ref, x @ w.to(device).t() + (bias if bias is not None else 0)) < 0.08


def test_block_fp8_gemm_refuses_bad_scales(device: torch.device) -> None:
    wq, ws = quantize_fp8_blocks(torch.randn(64, 128), (128, 128))
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        block_fp8_gemm(torch.randn(2, 128, device=device), wq.to(device), ws.to(device), 1)
    assert choose_splits(1, 4, 32, 132) == 16 and choose_splits(64, 64, 32, 132) == 1


# tile configurations and variants: 3 M-tiles x 3 N-tiles (partial last ones), 3 K blocks
CONFIGS = {
    "tiles": Fp8GemmConfig(block_m=16, block_n=32, num_warps=8, num_stages=2, num_splits=2),
    "grouped": Fp8GemmConfig(block_m=16, block_n=32, num_splits=1, group_m=2),
    "atomic": Fp8GemmConfig(block_m=32, block_n=64, num_splits=3, atomic_splits=True),
    "weight_only": Fp8GemmConfig(block_n=32, num_splits=2, weight_only=True),
    "weight_only_atomic": Fp8GemmConfig(
        block_n=64, num_splits=3, group_m=4, weight_only=True, atomic_splits=True
    ),
}


@pytest.mark.parametrize(
    "name,dtype",
    [(name, torch.float32) for name in CONFIGS] + [("weight_only_atomic", torch.bfloat16)],
    ids=[*CONFIGS, "weight_only_atomic-bf16"],
)
def test_block_fp8_gemm_configs_match_reference(
    device: torch.device, name: str, dtype: torch.dtype
) -> None:
    """Every variant against its reference: the activation-quantized matmul, or for
    ``weight_only`` the float32 matmul of ``x`` with the dequantized weights (atomic
    split sums differ from run to run in the last float32 bits only)."""
    cfg = CONFIGS[name]
    m, n, k = 40, 80, 384
    g = torch.Generator().manual_seed(7)
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05, (128, 128))
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    wq, ws, x, bias = wq.to(device), ws.to(device), x.to(device), bias.to(device)
    out = block_fp8_gemm(x, wq, ws, bias=bias, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    if cfg.weight_only:
        ref = x.float() @ dequantize_fp8_blocks(wq, ws, (128, 128)).t() + bias
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding
    else:
        ref = block_fp8_matmul_reference(x, wq, ws, bias).float()
        tol = 1e-2
    assert _rel(out, ref) < tol


def test_fp8_gemm_config_defaults_are_the_heuristic(device: torch.device) -> None:
    """``None`` fields resolve to the heuristic (llama-8b down_proj on 132 SMs), and an
    empty config launches exactly what no config does."""
    down = resolve_fp8_gemm_config(1, 4096, 14336, 132)  # split-K: 128-wide tiles
    assert down == Fp8GemmConfig(16, 128, 4, 3, 9, 1, False, False)
    gate_up = resolve_fp8_gemm_config(1, 28672, 4096, 132)  # 224 tiles of 128: no split
    assert gate_up == Fp8GemmConfig(16, 64, 4, 3, 1, 1, False, False)
    assert resolve_fp8_gemm_config(8192, 4096, 14336, 132) == Fp8GemmConfig(64, 128, 4, 3, 1, 1)
    # 64 rows splitting K: 256-wide tiles on 8 warps, about one program a multiprocessor
    assert resolve_fp8_gemm_config(64, 4096, 14336, 132) == Fp8GemmConfig(64, 256, 8, 3, 9, 1)
    assert resolve_fp8_gemm_config(20, 256, 256, 4, Fp8GemmConfig(num_splits=5)).num_splits == 2
    assert resolve_fp8_gemm_config(64, 4096, 14336, 132, Fp8GemmConfig(block_n=256)) == (
        Fp8GemmConfig(64, 256, 4, 3, 16, 1)  # 16 tiles: 17 splits wanted, 16 at most
    )
    with pytest.raises(ValueError, match="power of two"):
        Fp8GemmConfig(block_n=48)
    g = torch.Generator().manual_seed(3)
    wq, ws = quantize_fp8_blocks(torch.randn(96, 256, generator=g), (128, 128))
    x = torch.randn(3, 256, generator=g).to(device)
    wq, ws = wq.to(device), ws.to(device)
    assert torch.equal(block_fp8_gemm(x, wq, ws, config=Fp8GemmConfig()), block_fp8_gemm(x, wq, ws))


def test_fp8_kv_cache_write_matches_reference(device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, 2, 16, generator=g) * 3
    v = torch.randn(6, 2, 16, generator=g)
    k[0, 0, 0] = 1000.0  # saturates at 448 instead of turning into NaN
    slots = torch.tensor([5, 9, -1, 17, 2, 30])
    caches = [torch.zeros(2, 4, 8, 2, 16, dtype=FP8_DTYPE, device=device) for _ in range(2)]
    write_kv_cache(k.to(device), v.to(device), caches[0], slots.to(device))
    write_kv_cache_reference(k.to(device), v.to(device), caches[1], slots.to(device))
    got, want = caches[0].float(), caches[1].float()
    assert float(want.view(2, -1, 2, 16)[0, 5, 0, 0]) == 448.0
    # the interpreter rounds exact ties up and flushes subnormals; compiled kernels match
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0.07)


@pytest.mark.parametrize("kind", ["decode", "prefix_prefill"])
def test_triton_attention_reads_fp8_cache_as_reference(device: torch.device, kind: str) -> None:
    seq_lens, q_lens = {"decode": ([37, 20], [1, 1]), "prefix_prefill": ([40, 19], [9, 19])}[kind]
    pb = make_paged(seq_lens, q_lens, 2, 16, 16, torch.float32, device, seed=4)
    cache = pb.kv_cache.to(FP8_DTYPE)
    md: CommonAttentionMetadata = pb.common(device)
    t = md.num_actual_tokens
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(t, h, 16, generator=g).to(device) for h in (4, 2, 2))
    outs = []
    for backend in (TorchReferenceBackend(), TritonAttentionBackend(sdpa_prefill=False)):
        c = cache.clone()
        outs.append(backend.forward(q, k, v, c, backend.build_metadata(md), 0.25))
        assert c.dtype == FP8_DTYPE
    torch.testing.assert_close(outs[1], outs[0], **tol(torch.float32))
