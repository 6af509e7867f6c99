"""Parity of the Triton RMSNorm kernels with the model's norm."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_reference,
    rmsnorm,
    rmsnorm_reference,
)

SHAPES = [(5, 16), (7, 100), (3, 1024)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(shape[1])
    x, r = (torch.randn(shape, generator=g) * 3 for _ in range(2))
    w = torch.rand(shape[1], generator=g) + 0.5
    return [t.to(dtype).to(device) for t in (x, r, w)]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: tight. 16-bit: a couple of ulps (the CPU interpreter truncates when it
    casts fp32 to bf16 instead of rounding to nearest; the GPU test below is exact)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(device: torch.device, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x, _, w = _inputs(shape, dtype, device)
    out = rmsnorm(x, w, 1e-6)
    assert out.dtype == dtype
    _close(out, rmsnorm_reference(x, w, 1e-6), dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm(
    device: torch.device, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    x, r, w = _inputs(shape, dtype, device)
    out, res = fused_add_rmsnorm(x, r, w, 1e-5)
    ref_out, ref_res = fused_add_rmsnorm_reference(x, r, w, 1e-5)
    _close(res, ref_res, dtype)
    _close(out, ref_out, dtype)


def test_fused_add_rmsnorm_in_place(device: torch.device) -> None:
    x, r, w = _inputs((4, 64), torch.float32, device)
    ref_out, ref_res = fused_add_rmsnorm_reference(x, r, w, 1e-6)
    out, res = fused_add_rmsnorm(x, r, w, 1e-6, out=x, residual_out=r)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()
    torch.testing.assert_close(x, ref_out)
    torch.testing.assert_close(r, ref_res)


def test_rmsnorm_strided_rows(device: torch.device) -> None:
    """Row-strided input (a slice of a wider buffer) and 3-D input."""
    wide = torch.randn(6, 96, device=device)
    w = torch.rand(64, device=device)
    torch.testing.assert_close(
        rmsnorm(wide[:, :64], w, 1e-6), rmsnorm_reference(wide[:, :64], w, 1e-6)
    )
    x3 = torch.randn(2, 3, 64, device=device)
    torch.testing.assert_close(rmsnorm(x3, w, 1e-6), rmsnorm_reference(x3, w, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_bit_exact_on_gpu(dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    x, r, w = _inputs((64, 4096), dtype, dev)
    out, res = fused_add_rmsnorm(x, r, w, 1e-5)
    ref_out, ref_res = fused_add_rmsnorm_reference(x, r, w, 1e-5)
    assert torch.equal(res, ref_res)
    # rsqrt may differ from torch's by an ulp of fp32, which can flip a 16-bit rounding
    assert (out != ref_out).float().mean() < 1e-3
