"""Parity of the Triton SiLU-and-mul kernel with the model's torch form."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.activation import silu_and_mul, silu_and_mul_reference


@pytest.mark.parametrize("shape", [(1, 2 * 7), (5, 2 * 1000), (3, 2 * 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(device: torch.device, shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    out = silu_and_mul(x)
    ref = silu_and_mul_reference(x)
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # the interpreter truncates fp32 -> 16-bit casts; the GPU test below is exact
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_silu_and_mul_row_strided_and_3d(device: torch.device) -> None:
    wide = torch.randn(4, 40, device=device)
    torch.testing.assert_close(silu_and_mul(wide[:, :32]), silu_and_mul_reference(wide[:, :32]))
    x3 = torch.randn(2, 3, 16, device=device)
    out = silu_and_mul(x3)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, silu_and_mul_reference(x3))


def test_silu_and_mul_rejects_odd_width(device: torch.device) -> None:
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn(2, 5, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_bit_exact_on_gpu(dtype: torch.dtype) -> None:
    """bf16: bit-exact. fp16 (3 more mantissa bits) shows the last-ulp difference between
    Triton's exp and torch's expf in silu, so it is held to one fp16 ulp."""
    x = (torch.randn(64, 2 * 14336, device="cuda") * 4).to(dtype)
    out, ref = silu_and_mul(x), silu_and_mul_reference(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=2**-10)
