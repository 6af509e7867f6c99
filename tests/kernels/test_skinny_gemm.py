"""Parity of the decode-size GEMM (kernels/skinny_gemm.py) and its prologues with torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.reference import rms_norm, silu_and_mul_torch
from pdserve.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_gemm

CONFIGS = [
    SkinnyConfig(block_n=16, block_k=32),
    SkinnyConfig(block_n=8, block_k=16, row_dot=False),
    SkinnyConfig(block_n=16, block_k=32, prefetch=True),
    SkinnyConfig(block_n=8, block_k=16, row_dot=False, prefetch=True),
    SkinnyConfig(block_n=8, block_k=16, row_dot=False, early_w=1),
    SkinnyConfig(block_n=8, block_k=16, row_dot=False, early_w=2, prefetch=True),
    SkinnyConfig(block_n=16, block_k=32, swap=True),
]
IDS = ["dot", "registers", "dot-prefetch", "registers-prefetch", "registers-early1",
       "registers-early2", "dot-swapped"]  # fmt: skip


def _t(g: torch.Generator, *shape: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dev, dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: the sum's order only. 16-bit: the output's rounding (the CPU interpreter
    also truncates its fp32 -> bf16 casts)."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 3, 16, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_plain_and_bias(
    device: torch.device, rows: int, dtype: torch.dtype, cfg: SkinnyConfig
) -> None:
    if not cfg.row_dot and rows > 1:
        pytest.skip("the register path is the single-row path")
    g = torch.Generator().manual_seed(rows)
    x, w = _t(g, rows, 80, dtype=dtype, dev=device), _t(g, 40, 80, dtype=dtype, dev=device) * 0.1
    b = _t(g, 40, dtype=dtype, dev=device)
    y = skinny_gemm(x, w, config=cfg)
    assert isinstance(y, torch.Tensor) and y.shape == (rows, 40) and y.dtype == dtype
    _close(y, F.linear(x.float(), w.float()), dtype)
    _close(skinny_gemm(x, w, b, config=cfg), F.linear(x.float(), w.float(), b.float()), dtype)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_prologue(device: torch.device, rows: int, dtype: torch.dtype) -> None:
    """``norm(x + residual) @ W^T`` and the sum, as the add+RMSNorm kernel and a GEMM give
    them; without a residual, ``norm(x) @ W^T``."""
    g = torch.Generator().manual_seed(7 + rows)
    x, r = _t(g, rows, 96, dtype=dtype, dev=device), _t(g, rows, 96, dtype=dtype, dev=device)
    nw = (torch.rand(96, generator=g) + 0.5).to(device, dtype)
    w = _t(g, 48, 96, dtype=dtype, dev=device) * 0.1
    one_pass = [SkinnyConfig(block_n=16, block_k=32, one_pass_norm=True)] + (
        [SkinnyConfig(block_n=8, block_k=16, row_dot=False, one_pass_norm=True)] if rows == 1
        else []
    )  # fmt: skip
    for cfg in (CONFIGS if rows == 1 else CONFIGS[::2]) + one_pass:
        y, s = skinny_gemm(x, w, prologue="rmsnorm", residual=r, norm_weight=nw, eps=1e-5,
                           config=cfg)  # fmt: skip
        z = x + r
        _close(s, z, dtype)
        assert s.data_ptr() not in (x.data_ptr(), r.data_ptr())  # others still read r
        _close(y, F.linear(rms_norm(z, nw, 1e-5).float(), w.float()), dtype)
        y0 = skinny_gemm(x, w, prologue="rmsnorm", norm_weight=nw, eps=1e-5, config=cfg)
        assert isinstance(y0, torch.Tensor)
        _close(y0, F.linear(rms_norm(x, nw, 1e-5).float(), w.float()), dtype)


@pytest.mark.parametrize("rows", [1, 4, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_prologue(device: torch.device, rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11 + rows)
    gu = _t(g, rows, 2 * 64, dtype=dtype, dev=device)
    w = _t(g, 32, 64, dtype=dtype, dev=device) * 0.1
    for cfg in CONFIGS if rows == 1 else CONFIGS[::2]:
        y = skinny_gemm(gu, w, prologue="silu_mul", config=cfg)
        assert isinstance(y, torch.Tensor)
        _close(y, F.linear(silu_and_mul_torch(gu).float(), w.float()), dtype)


def test_default_config(device: torch.device) -> None:
    """No config: one row takes the register path, more rows the MMA tile; both give
    the reference under every prologue."""

    assert not default_config(1).row_dot and default_config(2).row_dot
    assert default_config(16).swap and not default_config(17).swap
    g = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    w = _t(g, 40, 80, dtype=dt, dev=device) * 0.1
    nw = (torch.rand(80, generator=g) + 0.5).to(device, dt)
    for rows in (1, 5):
        x, r = _t(g, rows, 80, dtype=dt, dev=device), _t(g, rows, 80, dtype=dt, dev=device)
        _close(skinny_gemm(x, w), F.linear(x.float(), w.float()), dt)
        y, _ = skinny_gemm(x, w, prologue="rmsnorm", residual=r, norm_weight=nw, eps=1e-5)
        _close(y, F.linear(rms_norm(x + r, nw, 1e-5).float(), w.float()), dt)
        gu = _t(g, rows, 160, dtype=dt, dev=device)
        ys = skinny_gemm(gu, w, prologue="silu_mul")
        _close(ys, F.linear(silu_and_mul_torch(gu).float(), w.float()), dt)


@pytest.mark.parametrize("split", [2, 3, 9])
def test_split_k(device: torch.device, split: int) -> None:
    """K cut into slices (9 asks for more than the 5 K steps: 5 slices of one): the plain
    GEMM with a bias, both prologues, FP8 weights; a second launch gives the same bits
    (the slices summed in order) and every launch leaves the tile counters at zero."""
    from pdserve.kernels.reference import FP8_DTYPE
    from pdserve.kernels.skinny_gemm import _COUNTERS

    g = torch.Generator().manual_seed(split)
    dt = torch.bfloat16
    reg = SkinnyConfig(block_n=8, block_k=16, row_dot=False, split_k=split, early_w=(split - 1) % 3)
    for rows, cfg in ((1, reg),
                      (5, SkinnyConfig(block_n=16, block_k=16, split_k=split, prefetch=True))):
        x, r = _t(g, rows, 80, dtype=dt, dev=device), _t(g, rows, 80, dtype=dt, dev=device)
        w, b = _t(g, 40, 80, dtype=dt, dev=device) * 0.1, _t(g, 40, dtype=dt, dev=device)
        y = skinny_gemm(x, w, b, config=cfg)
        _close(y, F.linear(x.float(), w.float(), b.float()), dt)
        assert torch.equal(skinny_gemm(x, w, b, config=cfg), y)
        nw = (torch.rand(80, generator=g) + 0.5).to(device, dt)
        yn, sn = skinny_gemm(x, w, prologue="rmsnorm", residual=r, norm_weight=nw, eps=1e-5,
                             config=cfg)  # fmt: skip
        _close(sn, x + r, dt)
        _close(yn, F.linear(rms_norm(x + r, nw, 1e-5).float(), w.float()), dt)
        gu = _t(g, rows, 160, dtype=dt, dev=device)
        ys = skinny_gemm(gu, w, prologue="silu_mul", config=cfg)
        _close(ys, F.linear(silu_and_mul_torch(gu).float(), w.float()), dt)
        assert not _COUNTERS[y.device].any()  # cuda:0, where the fixture says cuda
    w8 = (torch.randn(40, 300, generator=g) * 20).to(FP8_DTYPE).to(device)
    sc = (torch.rand(1, 3, generator=g) * 0.01).to(device)
    deq = w8.float() * sc.repeat_interleave(128, 1)[:, :300]
    x8 = _t(g, 2, 300, dtype=dt, dev=device)
    y8 = skinny_gemm(x8, w8, weight_scale=sc, config=SkinnyConfig(block_n=16, split_k=split))
    _close(y8, F.linear(x8.float(), deq), dt)
    assert not _COUNTERS[y8.device].any()


def test_3d_input_and_empty(device: torch.device) -> None:
    w = torch.randn(24, 32, device=device)
    x = torch.randn(2, 3, 32, device=device)
    y = skinny_gemm(x, w)
    assert isinstance(y, torch.Tensor) and y.shape == (2, 3, 24)
    _close(y, F.linear(x, w), torch.float32)
    e = skinny_gemm(torch.empty(0, 32, device=device), w)
    assert isinstance(e, torch.Tensor) and e.shape == (0, 24)


def test_refuses_mismatches(device: torch.device) -> None:
    w = torch.randn(24, 32, device=device)
    x = torch.randn(2, 32, device=device)
    with pytest.raises(ValueError, match="prologue must be one of"):
        skinny_gemm(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="needs 64"):
        skinny_gemm(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_gemm(x, w, prologue="rmsnorm")
    with pytest.raises(ValueError, match="belong to the 'rmsnorm' prologue"):
        skinny_gemm(x, w, residual=x)
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_gemm(x, torch.randn(32, 24, device=device).t())
    with pytest.raises(ValueError, match="early_w must be"):
        skinny_gemm(x, w, config=SkinnyConfig(early_w=3))
    with pytest.raises(ValueError, match="split_k 1"):
        skinny_gemm(x, w, prologue="rmsnorm", norm_weight=torch.ones(32, device=device),
                    config=SkinnyConfig(block_k=16, split_k=2, one_pass_norm=True))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_llama_shapes_on_gpu(rows: int) -> None:
    """The llama-8b-shape projections compiled: bf16 within the output's rounding of a
    float32 GEMM over the same bf16 inputs, the prologues' outputs too."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(rows)
    for n, k in ((6144, 4096), (4096, 14336)):
        x = _t(g, rows, k, dtype=torch.bfloat16, dev=dev)
        w = _t(g, n, k, dtype=torch.bfloat16, dev=dev) * 0.02
        ref = F.linear(x.float(), w.float())
        torch.testing.assert_close(skinny_gemm(x, w).float(), ref, atol=2e-2, rtol=2e-2)
        for split in (2, 4):  # the tiles' counters and partials under real concurrency
            ys = skinny_gemm(x, w, config=SkinnyConfig(split_k=split))
            torch.testing.assert_close(ys.float(), ref, atol=2e-2, rtol=2e-2)
            assert torch.equal(skinny_gemm(x, w, config=SkinnyConfig(split_k=split)), ys)
        r = _t(g, rows, k, dtype=torch.bfloat16, dev=dev)
        nw = (torch.rand(k, generator=g) + 0.5).to(dev, torch.bfloat16)
        y, s = skinny_gemm(x, w, prologue="rmsnorm", residual=r, norm_weight=nw, eps=1e-5)
        assert torch.equal(s, x + r)
        ref_n = F.linear(rms_norm(x + r, nw, 1e-5).float(), w.float())
        torch.testing.assert_close(y.float(), ref_n, atol=3e-2, rtol=2e-2)
        y1, s1 = skinny_gemm(x, w, prologue="rmsnorm", residual=r, norm_weight=nw, eps=1e-5,
                             config=SkinnyConfig(one_pass_norm=True))  # fmt: skip
        assert torch.equal(s1, x + r)
        torch.testing.assert_close(y1.float(), ref_n, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("scale_rows", [128, 1])
def test_fp8_weights(device: torch.device, rows: int, scale_rows: int) -> None:
    """Block-scaled FP8 weights, weight-only: ``x @ (w * scale)^T`` in float32, with the
    prologues too; K not a multiple of 128 (the last block partial)."""
    from pdserve.kernels.reference import FP8_DTYPE

    g = torch.Generator().manual_seed(rows + scale_rows)
    n, k = 40, 200
    w = (torch.randn(n, k, generator=g) * 20).to(FP8_DTYPE).to(device)
    s = (torch.rand(-(-n // scale_rows), 2, generator=g) * 0.01).to(device)
    deq = w.float() * s.repeat_interleave(scale_rows, 0)[:n].repeat_interleave(128, 1)[:, :k]
    x = torch.randn(rows, k, generator=g).to(device, torch.bfloat16)
    for cfg in CONFIGS if rows == 1 else CONFIGS[::2]:
        y = skinny_gemm(x, w, weight_scale=s, scale_rows=scale_rows, config=cfg)
        _close(y, F.linear(x.float(), deq), torch.bfloat16)
        gu = torch.randn(rows, 2 * k, generator=g).to(device, torch.bfloat16)
        y2 = skinny_gemm(gu, w, prologue="silu_mul", weight_scale=s, scale_rows=scale_rows,
                         config=cfg)  # fmt: skip
        _close(y2, F.linear(silu_and_mul_torch(gu).float(), deq), torch.bfloat16)
    with pytest.raises(ValueError, match="one per block"):
        skinny_gemm(x, w, weight_scale=s[:, :1], scale_rows=scale_rows)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("k", [330, 332])
def test_fp8_wide_steps(device: torch.device, rows: int, k: int) -> None:
    """K steps wider than a scale block (each activation column scaled by its 128-group's
    scale), on both paths, split-K and early weight steps too; K 330 / 332: the last
    step's second group partial, its third past K; the register path reads K 332's rows
    as int32 words, K 330's byte by byte. Per-row scales (``scale_rows`` 1) keep the
    128-wide steps."""
    from pdserve.kernels.reference import FP8_DTYPE
    from pdserve.kernels.skinny_gemm import wide_fp8_steps

    g = torch.Generator().manual_seed(rows)
    n = 48
    w = (torch.randn(n, k, generator=g) * 20).to(FP8_DTYPE).to(device)
    s = (torch.rand(1, 3, generator=g) * 0.01 + 1e-3).to(device)
    deq = w.float() * s.repeat_interleave(128, 1)[:, :k]
    x = torch.randn(rows, k, generator=g).to(device, torch.bfloat16)
    gu = torch.randn(rows, 2 * k, generator=g).to(device, torch.bfloat16)
    wide = [SkinnyConfig(block_n=16, block_k=256), SkinnyConfig(block_n=16, block_k=256, split_k=2),
            SkinnyConfig(block_n=8, block_k=256, row_dot=False, early_w=2),
            SkinnyConfig(block_n=8, block_k=512, row_dot=False),
            SkinnyConfig(block_n=16, block_k=256, swap=True, split_k=2)]  # fmt: skip
    for cfg in wide:
        assert wide_fp8_steps(cfg, 128) and not wide_fp8_steps(cfg, 1)
        y = skinny_gemm(x, w, weight_scale=s, config=cfg)
        _close(y, F.linear(x.float(), deq), torch.bfloat16)
        y2 = skinny_gemm(gu, w, prologue="silu_mul", weight_scale=s, config=cfg)
        _close(y2, F.linear(silu_and_mul_torch(gu).float(), deq), torch.bfloat16)
    # rows of whole int32 words but K not (a view of a wider weight): byte loads, K 258
    y = skinny_gemm(x[:, :258], w[:, :258], weight_scale=s, config=wide[2])
    _close(y, F.linear(x[:, :258].float(), deq[:, :258]), torch.bfloat16)
    # the default tiles (one row: the register path's wide steps; more: 128-wide steps,
    # split-K up to 4 slices)
    y = skinny_gemm(x, w, weight_scale=s)
    _close(y, F.linear(x.float(), deq), torch.bfloat16)
    cfg = default_config(16, fp8=True, n=6144, sms=132)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (64, 128, 4)
    assert default_config(16, fp8=True, n=28672, sms=132).split_k == 1
    assert default_config(1, fp8=True).early_w == 0 and wide_fp8_steps(default_config(1), 128)
    assert not wide_fp8_steps(SkinnyConfig(block_n=16, block_k=128), 128)
    assert not wide_fp8_steps(SkinnyConfig(block_n=32, block_k=192), 128)
