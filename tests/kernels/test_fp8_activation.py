"""FP8 activations quantized by their producer: the RMSNorm and SiLU-and-mul kernels'
fp8 output mode, and the block-FP8 GEMM reading them.

Parity rules: a producer's fp8 output is the quantization (per token per 128 channels,
:func:`~pdserve.kernels.reference.quantize_fp8_groups`) of the output it writes in its
normal mode, so against torch's quantization of that output it is exact in the
interpreter (values and scales); compiled, Triton's float32 division need not round
correctly, so there a value may sit one e4m3 ulp away and a scale 2 float32 ulps.
Against the torch reference it is within one e4m3 ulp per value: the interpreter
truncates the fp32 -> bf16 casts where torch rounds (the norm casts twice, before and
after the weight multiply: up to two bf16 ulps, 2^-7 relative each, which moves an fp8
value at most one of its own ulps, 2^-3 relative, and a group's scale by at most 2^-5
relative); compiled, the casts round as torch does (the ``gpu`` test). The GEMM and the
fused experts fed an ``Fp8Activation`` compute what they compute from the bf16
activation it was quantized from (the same quantization, done by the producer instead
of by every tile): equal to float32 accumulation order in the interpreter (1e-5),
within the compiled kernels' FP8 tolerance of their own tests (1e-2) on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from pdserve.kernels.activation import (
    quantize_fp8,
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_reference,
)
from pdserve.kernels.fp8_gemm import block_fp8_gemm
from pdserve.kernels.reference import (
    Fp8Activation,
    block_fp8_matmul_reference,
    quantize_fp8_activation,
    quantize_fp8_blocks,
)
from pdserve.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_fp8,
    fused_add_rmsnorm_fp8_reference,
    rmsnorm,
    rmsnorm_fp8,
    rmsnorm_fp8_reference,
    rmsnorm_reference,
)
from pdserve.layers.norm import RMSNorm
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint


def _signed_code(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes as integers ordered like their values (adjacent values differ by 1;
    -0 and 0 are both 0)."""
    code = q.view(torch.uint8).int()
    return torch.where(code >= 128, -(code - 128), code)


def _assert_same(a: Fp8Activation, b: Fp8Activation) -> None:
    """Equal in the interpreter; within the compiled division's rounding on a GPU."""
    assert a.dtype == b.dtype and a.q.shape == b.q.shape and a.scale.shape == b.scale.shape
    if a.q.is_cuda:
        _assert_within_ulp(a, b, 2**-22)
        return
    assert torch.equal(a.q.float().cpu(), b.q.float().cpu())  # values: -0 == 0
    assert torch.equal(a.scale.cpu(), b.scale.cpu())


def _assert_within_ulp(a: Fp8Activation, b: Fp8Activation, scale_rtol: float = 2**-5) -> None:
    assert a.q.shape == b.q.shape and a.scale.shape == b.scale.shape
    assert int((_signed_code(a.q.cpu()) - _signed_code(b.q.cpu())).abs().max()) <= 1
    torch.testing.assert_close(a.scale.cpu(), b.scale.cpu(), rtol=scale_rtol, atol=0)


SHAPES = [(5, 256), (3, 200), (2, 64)]  # whole groups, a partial last group, under one


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_fp8_out(device: torch.device, shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x, r = ((torch.randn(shape, generator=g) * 3).to(dtype).to(device) for _ in range(2))
    w = (torch.rand(shape[1], generator=g) + 0.5).to(dtype).to(device)
    act = rmsnorm_fp8(x, w, 1e-6)
    assert act.q.dtype == torch.float8_e4m3fn and act.scale.shape == (shape[0], -(-shape[1] // 128))
    _assert_same(act, quantize_fp8_activation(rmsnorm(x, w, 1e-6)))
    _assert_within_ulp(act, rmsnorm_fp8_reference(x, w, 1e-6))
    act, z = fused_add_rmsnorm_fp8(x, r, w, 1e-6)
    plain, z_plain = fused_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(z, z_plain)
    _assert_same(act, quantize_fp8_activation(plain))
    ref, z_ref = fused_add_rmsnorm_fp8_reference(x, r, w, 1e-6)
    _assert_within_ulp(act, ref)
    torch.testing.assert_close(z.float(), z_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", [(1, 2 * 7), (3, 2 * 1000), (2, 2 * 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_fp8_out(
    device: torch.device, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
    act = silu_and_mul_fp8(x)
    assert act.scale.shape == (shape[0], -(-shape[1] // 2 // 128)) and act.dtype == dtype
    _assert_same(act, quantize_fp8_activation(silu_and_mul(x)))
    _assert_within_ulp(act, silu_and_mul_fp8_reference(x))


@pytest.mark.parametrize("m,n,k,scale_rows,splits", [(3, 192, 256, 128, None), (20, 96, 200, 1, 2)])
def test_block_fp8_gemm_reads_a_prequantized_activation(
    device: torch.device, m: int, n: int, k: int, scale_rows: int, splits: int | None
) -> None:
    g = torch.Generator().manual_seed(m)
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05, (scale_rows, 128))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    wq, ws, x = wq.to(device), ws.to(device), x.to(device)
    act = quantize_fp8_activation(x)
    out = block_fp8_gemm(act, wq, ws, scale_rows, num_splits=splits)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    from_bf16 = block_fp8_gemm(x, wq, ws, scale_rows, num_splits=splits)
    torch.testing.assert_close(out.float(), from_bf16.float(), atol=1e-2, rtol=1e-2)
    ref = block_fp8_matmul_reference(act, wq, ws, scale_rows=scale_rows)
    assert torch.equal(ref, block_fp8_matmul_reference(x, wq, ws, scale_rows=scale_rows))
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2
    # 3-D leading dims go through as with a tensor
    act3 = Fp8Activation(act.q.view(1, m, k), act.scale.view(1, m, -1), act.dtype)
    assert block_fp8_gemm(act3, wq, ws, scale_rows, num_splits=splits).shape == (1, m, n)


def test_weight_only_refuses_a_prequantized_activation(device: torch.device) -> None:
    from pdserve.kernels.fp8_gemm import Fp8GemmConfig

    wq, ws = quantize_fp8_blocks(torch.randn(64, 128), (128, 128))
    act = quantize_fp8_activation(torch.randn(2, 128, device=device))
    with pytest.raises(ValueError, match="weight_only"):
        block_fp8_gemm(act, wq.to(device), ws.to(device), config=Fp8GemmConfig(weight_only=True))


@pytest.mark.gpu
def test_producers_fp8_out_on_gpu() -> None:
    """Compiled, the producers round their bf16 output as torch does (bit for bit, the
    plain kernels' GPU tests); what may still differ is the division by the scale
    (Triton's fp32 division need not be correctly rounded): within one e4m3 ulp, scales
    within 2 fp32 ulps."""
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn_like(x)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    tight = 2**-22
    _assert_within_ulp(rmsnorm_fp8(x, w, 1e-6), rmsnorm_fp8_reference(x, w, 1e-6), tight)
    both, _ = fused_add_rmsnorm_fp8(x, r, w, 1e-6, keep_hp=True)
    ref, _ = fused_add_rmsnorm_fp8_reference(x, r, w, 1e-6, keep_hp=True)
    _assert_within_ulp(both, ref, tight)
    assert ref.hp is not None and torch.equal(both.high_precision(), ref.hp)
    h = torch.randn(64, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 4
    _assert_within_ulp(silu_and_mul_fp8(h), silu_and_mul_fp8_reference(h), tight)


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM"]
)
def test_fused_model_with_fp8_producers_gives_the_same_logits(
    arch: str, tmp_path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernels end to end (FP8 at load): the producers' fp8 output feeds the
    block-FP8 GEMM the values it would have quantized itself. DeepSeek-V3 (no indexer):
    the input norm feeds q_a and kv_a, q_a's norm q_b, the dense and shared SiLU-and-mul
    their down projections. GLM-5: the norms also keep their bf16 output for the DSA
    indexer and the MoE router, and the FP8 fused experts read the fp8 rows."""
    ckpt = make_checkpoint(
        arch, "tiny", tmp_path, seed=5, dtype="float32", config_overrides={"num_hidden_layers": 2}
    )
    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "1")
    # 13 rows would take Llama's decode-size GEMM where it is on, which bypasses the FP8
    # producers (test_fp8_llama_decode_rows_read_the_weights_unquantized_activations)
    monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "0")
    model, cfg = load_model(ckpt, "float32", device, quantization="fp8")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.quant_out]
    assert norms and all(m.fused for m in norms)
    ids = torch.randint(3, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    logits = []
    for _ in range(2):
        kv = PagedKV(model, 1, 16)
        with torch.no_grad(), kv.step([0], [13]):
            logits.append(model.compute_logits(model(ids.to(device), torch.arange(13).to(device))))
        for m in model.modules():  # second pass: every producer bf16, the GEMM quantizes
            if hasattr(m, "quant_out"):
                m.quant_out = False
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_llama_takes_the_decode_size_gemm_to_16_rows_in_bf16_and_one_in_fp8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where PDSERVE_SKINNY_ROWS does not say: a bf16 Llama's linears take decode rows up
    to 16 on the decode-size GEMM, and its steps of at most 16 tokens launch dependently;
    an FP8 Llama's take one row there (more rows keep the block-FP8 GEMM) and its
    one-token steps launch dependently (run 131)."""
    from pdserve.layers import fused
    from pdserve.layers.fp8 import Fp8Linear
    from pdserve.layers.linear import Linear

    ckpt = make_checkpoint("LlamaForCausalLM", "tiny", tmp_path, config_only=True,
                           config_overrides={"num_hidden_layers": 1})  # fmt: skip
    monkeypatch.delenv("PDSERVE_SKINNY_ROWS", raising=False)
    # the fused kernels "on" for the model's own device only: the choice must ask about
    # it, not the default device (a GPU model is configured outside its device context)
    monkeypatch.setattr(fused, "use_fused_kernels", lambda device=None: device is not None
                        and torch.device(device).type == "cpu")  # fmt: skip
    for quant, rows, fp8s in ((None, 16, 0), ("fp8", 1, 4)):
        model, _ = load_model(ckpt, "bfloat16", "cpu", load_format="dummy", quantization=quant)
        lins = [m for m in model.modules() if isinstance(m, Linear)]
        assert sum(isinstance(m, Fp8Linear) for m in lins) == fp8s
        assert lins and {m.skinny_rows for m in lins} == {rows}
        assert model.pdl_tokens == rows


def test_fp8_llama_decode_rows_read_the_weights_unquantized_activations(
    tmp_path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode rows of an FP8 Llama take the decode-size GEMM over the FP8 weights, the
    norms and SiLU-and-mul giving it unquantized activations (their fp8 output mode
    bypassed): the logits of every block-FP8 linear computed as ``x @ dequantize(W)^T``
    in float32."""
    from pdserve.kernels.reference import dequantize_fp8_blocks
    from pdserve.layers import fp8 as fp8_layers
    from pdserve.layers.fp8 import Fp8Linear

    ckpt = make_checkpoint("LlamaForCausalLM", "tiny", tmp_path, seed=5, dtype="float32",
                           config_overrides={"num_hidden_layers": 2})  # fmt: skip
    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "1")
    monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "16")
    model, cfg = load_model(ckpt, "float32", device, quantization="fp8")
    fp8s = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8s and all(m.skinny_rows > 0 for m in fp8s)
    ids = torch.randint(3, cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(2))
    logits = []
    for _ in range(2):
        kv = PagedKV(model, 1, 16)
        with torch.no_grad(), kv.step([0], [5]):
            logits.append(model.compute_logits(model(ids.to(device), torch.arange(5).to(device))))
        # second pass, the reference: no decode-size GEMM, plain producers, and every FP8
        # linear a float32 matmul over its dequantized weights
        for m in model.modules():
            if hasattr(m, "quant_out"):
                m.quant_out = False
            if hasattr(m, "skinny_rows"):
                m.skinny_rows = 0

        def weight_only(x, w, s, bias, rows, fused):  # type: ignore[no-untyped-def]
            deq = dequantize_fp8_blocks(w, s, (rows, 128))
            return torch.nn.functional.linear(x.float(), deq, bias).to(x.dtype)

        monkeypatch.setattr(fp8_layers, "fp8_linear", weight_only)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_rmsnorm_fp8_keeps_its_output_beside(device: torch.device) -> None:
    """``keep_hp``: one kernel writes the fp8 activation and the norm's own output (for
    the MoE router or the DSA indexer), each what the separate modes write."""
    g = torch.Generator().manual_seed(7)
    x, r = ((torch.randn(4, 200, generator=g) * 3).to(torch.bfloat16).to(device) for _ in "ab")
    w = (torch.rand(200, generator=g) + 0.5).to(torch.bfloat16).to(device)
    both = rmsnorm_fp8(x, w, 1e-6, keep_hp=True)
    assert both.hp is not None and torch.equal(both.hp, rmsnorm(x, w, 1e-6))
    _assert_same(both, rmsnorm_fp8(x, w, 1e-6))
    assert rmsnorm_fp8(x, w, 1e-6).hp is None
    both, z = fused_add_rmsnorm_fp8(x, r, w, 1e-6, keep_hp=True)
    plain, z_plain = fused_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(z, z_plain) and both.high_precision().equal(plain)
    _assert_same(both, quantize_fp8_activation(plain))
    ref = rmsnorm_fp8_reference(x, w, 1e-6, keep_hp=True)
    assert ref.hp is not None and ref.hp.equal(rmsnorm_reference(x, w, 1e-6))


@pytest.mark.parametrize("t,dtype", [(5, torch.float32), (9, torch.bfloat16)])
def test_fused_experts_fp8_reads_a_prequantized_activation(
    device: torch.device, t: int, dtype: torch.dtype
) -> None:
    """The gate/up kernel loads the producer's fp8 rows and scales (no per-program
    quantization of x): the values the kernel computes from the bf16 rows it quantizes
    itself, to float32 accumulation order (1e-5 of the largest output in float32; bf16
    output: 2e-2, the per-pair rounding of the module's tests; compiled: 1e-2)."""
    from pdserve.kernels.fused_moe_fp8 import fused_experts_fp8
    from pdserve.kernels.reference import fused_experts_fp8_reference, quantize_fp8_experts

    g = torch.Generator().manual_seed(t)
    e, k, h, inter = 4, 2, 200, 160
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter**-0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(t, k, generator=g).to(device)
    q13, s13, q2, s2 = (a.to(device) for a in quantize_fp8_experts(w13, w2))
    act = quantize_fp8_activation(x, keep_hp=True)
    out = fused_experts_fp8(act, q13, s13, q2, s2, weights, ids)
    assert out.dtype == dtype and out.shape == (t, h)
    from_x = fused_experts_fp8(x, q13, s13, q2, s2, weights, ids)
    tol = 1e-2 if device.type == "cuda" else 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - from_x.float()).abs().max() / from_x.float().abs().max()) < tol
    ref = fused_experts_fp8_reference(act, q13, s13, q2, s2, weights, ids)
    assert torch.equal(ref, fused_experts_fp8_reference(x, q13, s13, q2, s2, weights, ids))
    assert float((out.float() - ref.float()).abs().max() / ref.float().abs().max()) < tol


@pytest.mark.parametrize("splits,bias", [(3, False), (16, True)])
def test_splitk_sum_is_torchs_sum_bias_and_cast(
    device: torch.device, splits: int, bias: bool
) -> None:
    """The split-K epilogue in one launch: float32 sum over the splits, plus the bias, one
    rounding to the output dtype (torch sums dim 0 in another order: 1e-6 relative)."""
    from pdserve.kernels.fp8_gemm import splitk_sum

    g = torch.Generator().manual_seed(splits)
    parts = torch.randn(splits, 5, 1100, generator=g).to(device)
    b = torch.randn(1100, generator=g).to(torch.bfloat16).to(device) if bias else None
    want = parts.sum(0) + (b.float() if b is not None else 0)
    got = splitk_sum(parts, b, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    got16 = splitk_sum(parts, b, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(
        got16.float(), want.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-2
    )


def test_rmsnorm_fp8_in_place(device: torch.device) -> None:
    """The quantizing norm reads its row twice (once per layout); the residual written in
    place (``residual_out=residual``) must not feed the second read."""
    g = torch.Generator().manual_seed(11)
    x, r = ((torch.randn(6, 384, generator=g) * 3).to(torch.bfloat16).to(device) for _ in "ab")
    w = (torch.rand(384, generator=g) + 0.5).to(torch.bfloat16).to(device)
    want, z_want = fused_add_rmsnorm_fp8(x, r.clone(), w, 1e-6, keep_hp=True)
    got, z = fused_add_rmsnorm_fp8(x, r, w, 1e-6, residual_out=r, keep_hp=True)
    assert z.data_ptr() == r.data_ptr() and torch.equal(z, z_want)
    _assert_same(got, want)
    assert torch.equal(got.high_precision(), want.high_precision())


@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 200), (4, 2048 + 64), (1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_is_the_reference_quantization(
    device: torch.device, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """The one-launch quantization of a plain activation (a GEMM input no producer
    quantized): torch's per-token per-128-channel values and scales, any leading shape,
    partial last groups, more than one program per row."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 5).to(dtype).to(device)
    got = quantize_fp8(x)
    assert got.q.shape == x.shape and got.scale.shape == (*shape[:-1], -(-shape[-1] // 128))
    assert got.dtype == dtype and got.hp is None
    _assert_same(
        Fp8Activation(got.q.reshape(-1, shape[-1]), got.scale.reshape(-1, got.scale.shape[-1]),
                      dtype),
        quantize_fp8_activation(x.reshape(-1, shape[-1])),
    )  # fmt: skip
