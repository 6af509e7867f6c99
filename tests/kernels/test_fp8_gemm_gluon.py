"""The Gluon FP8 GEMM (kernels/fp8_gemm_gluon.py): parity with the block-FP8 reference and
the Triton kernel on a Hopper GPU (Gluon has no CPU interpreter; tools/sm90_report.py
compiles it for sm_90a in the CPU suite), what it refuses, the FP8 linear's dispatch to
it, and benchmarks/fp8_gemm_compare.py's smoke run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import fp8_gemm_gluon
from pdserve.kernels.fp8_gemm import block_fp8_gemm
from pdserve.kernels.reference import (
    Fp8Activation,
    block_fp8_matmul_reference,
    quantize_fp8_activation,
    quantize_fp8_blocks,
)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_gemm_compare.py"

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="the Gluon kernel is for Hopper (sm_90)",
)


def _operands(device: torch.device, m: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
    w, ws = quantize_fp8_blocks(torch.randn(n, k, generator=g).to(device), (128, 128))
    return quantize_fp8_activation(x), w, ws


@hopper
@pytest.mark.parametrize("m,n,k", [(1024, 512, 1024),  # whole tiles
                                   (300, 320, 1040),  # M, N and K tails (a partial K block)
                                   (2048, 4096, 256),
                                   # decode batches (the swapped kernel): split K with a
                                   # short last split, one split, 33-64 rows, N tails
                                   (1, 4096, 14336), (5, 28672, 1024), (16, 200, 1040),
                                   (64, 6144, 4096), (40, 320, 640)])  # fmt: skip
@pytest.mark.parametrize("prefill_kernel", fp8_gemm_gluon.PREFILL_KERNELS)
def test_gluon_fp8_gemm_matches_reference(m: int, n: int, k: int, prefill_kernel: str) -> None:
    if m <= fp8_gemm_gluon.DECODE_MAX_ROWS and prefill_kernel != fp8_gemm_gluon.PREFILL_KERNEL:
        pytest.skip("decode rows take the swapped kernel whatever the prefill kernel")
    xq, w, ws = _operands(torch.device("cuda"), m, n, k, m + n)
    got = fp8_gemm_gluon.fp8_gemm_gluon(xq, w, ws, 128, torch.bfloat16, prefill_kernel)
    want = block_fp8_matmul_reference(xq, w, ws, None, scale_rows=128)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # Hopper's fp8 MMA adds a K step's products at less than float32 precision (the H200
    # measured 0.04 off on outputs of magnitude ~300 at K 4096, near-zero outputs showing
    # it): the absolute tolerance follows the output's scale; a wrong tile, scale or K
    # step is off by about the output's spread
    atol = max(2e-2, 5e-4 * want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2e-2)
    triton_out = block_fp8_gemm(xq, w, ws)
    torch.testing.assert_close(got.float(), triton_out.float(), atol=atol, rtol=2e-2)


def test_prefill_kernels_compile_once_for_every_row_count() -> None:
    """The prefill kernels do not specialise on M (rows): a step whose token count is
    not a multiple of 16 would otherwise compile another variant under traffic (run 136:
    the first offline pass of llama-8b-shape FP8 compiled one ws variant the warm-up had
    not)."""
    from pdserve.kernels import fp8_gemm_gluon_ws

    for kernel in (fp8_gemm_gluon._fp8_gemm_tma_kernel, fp8_gemm_gluon_ws._fp8_gemm_ws_kernel):
        assert [p.do_not_specialize for p in kernel.params if p.name == "M"] == [True]


def test_gluon_fp8_gemm_refuses_what_it_does_not_run(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    xq, w, ws = _operands(device, 32, 256, 256, 1)
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    assert fp8_gemm_gluon.supported(xq, w, 128, None, torch.bfloat16) == on_hopper
    assert not fp8_gemm_gluon.supported(xq.q.float(), w, 128, None, torch.bfloat16)  # not fp8
    assert not fp8_gemm_gluon.supported(xq, w, 1, None, torch.bfloat16)  # per-row scales
    assert not fp8_gemm_gluon.supported(xq, w, 128, torch.zeros(256), torch.bfloat16)
    assert not fp8_gemm_gluon.supported(xq, w, 128, None, torch.float32)
    with pytest.raises(ValueError, match="prefill_kernel"):
        fp8_gemm_gluon.fp8_gemm_gluon(xq, w, ws, 128, torch.bfloat16, "wgmma")
    with monkeypatch.context() as mp:  # the engine's choice through the environment
        mp.setenv(fp8_gemm_gluon.PREFILL_ENV, "wgmma")
        with pytest.raises(ValueError, match="PDSERVE_FP8_PREFILL"):
            fp8_gemm_gluon.fp8_gemm_gluon(xq, w, ws, 128, torch.bfloat16)
    if not on_hopper:
        with pytest.raises(ValueError, match="sm_90"):
            fp8_gemm_gluon.fp8_gemm_gluon(xq, w, ws, 128, torch.bfloat16)


def test_fp8_linear_keeps_the_triton_kernel_where_gluon_does_not_apply(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the Gluon path switched on, a batch it cannot take (here: not Hopper, or not
    producer-quantized) runs the Triton kernel: the same output as with it off."""
    from pdserve.layers import fp8

    xq, w, ws = _operands(device, 40, 256, 256, 2)
    monkeypatch.setattr(fp8, "GLUON_FP8", False)
    off = fp8.fp8_linear(xq, w, ws, None, 128, fused=True)
    monkeypatch.setattr(fp8, "GLUON_FP8", True)
    monkeypatch.setattr(fp8, "GLUON_MIN_TOKENS", 32)
    on = fp8.fp8_linear(xq, w, ws, None, 128, fused=True)
    assert isinstance(xq, Fp8Activation)
    if not (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9):
        torch.testing.assert_close(on, off, atol=0, rtol=0)
    else:  # Hopper: the Gluon kernel ran, within the kernels' tolerance of each other
        torch.testing.assert_close(on.float(), off.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script is a benchmark run")
def test_fp8_gemm_compare_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("fp8_gemm_compare", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fp8_gemm_compare"] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "g.json"
    assert mod.main(["--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    by_phase: dict[str, dict[str, dict]] = {}
    for r in res["rows"]:
        by_phase.setdefault(r["phase"], {})[r["impl"]] = r
    assert set(by_phase["decode"]) == {"triton", "gluon", "bf16"}
    assert set(by_phase["prefill"]) == {"triton", "triton_big", "gluon", "gluon_tma",
                                        "gluon_ws", "scaled_mm", "bf16"}  # fmt: skip
    for phase, rows in by_phase.items():
        for name, r in rows.items():
            if name in ("gluon", "gluon_tma", "gluon_ws", "scaled_mm"):
                assert "skipped" in r, r
                continue
            assert r["ms"] > 0 and not r["bad"] and r["bytes"] > 0, (phase, r)
    assert "Hopper" in by_phase["decode"]["gluon"]["skipped"]
    assert res["fp8_peak_flops"] is None and res["copy_Bps"] is None
    assert "fp8 GEMM, decode" in capsys.readouterr().out
    assert mod.main(["--device", "cpu", "--out", str(out), "--prefill-only",
                     "--impls", "triton,gluon_ws"]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {(r["phase"], r["impl"]) for r in rows} == {("prefill", "triton"),
                                                        ("prefill", "gluon_ws")}  # fmt: skip


def test_fp8_linear_quantizes_a_plain_input_for_gluon(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill-sized bf16 input (no quantizing producer: o_proj after attention) runs the
    Gluon kernel on Hopper after one quantizing launch (``GLUON_QUANTIZE``), within the
    kernels' tolerance of the Triton kernel that quantizes per tile; elsewhere, and with
    ``GLUON_QUANTIZE`` off, the Triton kernel."""
    from pdserve.layers import fp8

    xq, w, ws = _operands(device, 64, 256, 384, 3)
    x = xq.dequantize(torch.bfloat16)
    calls = []
    real = fp8_gemm_gluon.fp8_gemm_gluon
    monkeypatch.setattr(fp8_gemm_gluon, "fp8_gemm_gluon", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fp8, "GLUON_MIN_TOKENS", 32)
    monkeypatch.setattr(fp8, "GLUON_QUANTIZE", False)
    triton_out = fp8.fp8_linear(x, w, ws, None, 128, fused=True)
    assert not calls
    monkeypatch.setattr(fp8, "GLUON_QUANTIZE", True)
    out = fp8.fp8_linear(x, w, ws, None, 128, fused=True)
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    assert fp8_gemm_gluon.supported(x, w, 128, None, x.dtype, quantizable=True) == on_hopper
    assert len(calls) == int(on_hopper)
    torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=2e-2)
