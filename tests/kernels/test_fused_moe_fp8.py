"""The block-FP8 fused MoE kernels against their dequantize-then-compute torch reference,
and the reference against the plain float32 experts.

Tolerances (max |difference| over the output's max |value|): the kernels quantize the
activations exactly as the reference does, so in float32 they differ by accumulation
order only: 1e-5 in the interpreter (it reaches ~5e-7); compiled on a GPU, whose FP8 MMAs
accumulate with fewer bits, a rare fp8 rounding of an intermediate activation may land
on the other side: 1e-2. bf16: each (token, expert) row is rounded to bf16 before the
sum (the interpreter truncates that cast, torch rounds): 2e-2. The reference is the
unquantized float32 experts within FP8 quantization of weights and activations (two
GEMMs; ~6% here): 0.1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _attn_helper import PagedKV
from pdserve.kernels import fused_moe_fp8
from pdserve.kernels.fused_moe_fp8 import fused_experts_fp8
from pdserve.kernels.reference import (
    FP8_DTYPE,
    dequantize_fp8_experts,
    fused_experts_fp8_reference,
    quantize_fp8_experts,
)
from pdserve.layers.moe import RoutedExperts, experts_sorted
from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _problem(t: int, e: int, k: int, h: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    # magnitudes that differ by expert, by row and by channel, so every scale matters
    spread = torch.linspace(0.5, 2, e)[:, None, None]
    w13 = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5 * torch.linspace(0.2, 2, h)
    w13 = w13 * spread * torch.linspace(0.3, 3, 2 * inter)[:, None]
    w2 = torch.randn(e, h, inter, generator=g) * inter**-0.5 * torch.linspace(3, 0.3, h)[:, None]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, w13, w2, torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize(
    "t,e,k,h,inter,dtype",
    [
        (1, 4, 2, 128, 128, torch.float32),  # one decode token, aligned blocks
        (13, 8, 3, 200, 72, torch.float32),  # H and I off the 128 grid: partial blocks
        (9, 4, 2, 256, 160, torch.bfloat16),
    ],
)
def test_fused_experts_fp8_matches_reference(
    device: torch.device, t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype
) -> None:
    x, w13, w2, weights, ids = _problem(t, e, k, h, inter, seed=t + h)
    q13, s13, q2, s2 = quantize_fp8_experts(w13, w2)
    assert q13.dtype == FP8_DTYPE and s13.shape == (e, 2 * -(-inter // 128), -(-h // 128))
    assert s2.shape == (e, -(-h // 128), -(-inter // 128))
    args = [a.to(device) for a in (q13, s13, q2, s2, weights, ids)]
    xd = x.to(dtype).to(device)
    out = fused_experts_fp8(xd, args[0], args[1], args[2], args[3], args[4], args[5])
    ref = fused_experts_fp8_reference(xd, *args)
    assert out.shape == (t, h) and out.dtype == dtype and ref.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5 if device.type == "cpu" else 1e-2
    assert _rel(out, ref) < tol
    # the reference is the plain float32 experts within FP8 quantization error
    plain = experts_sorted(x, w13, w2, weights, ids)
    assert _rel(ref.cpu(), plain) < 0.1


@pytest.mark.parametrize(
    "tiles", [(128, 128, 16), (64, 128, 8), (16, 64, 4), (16, 64, 4, 3), (64, 128, 8, 2)]
)
def test_fused_experts_fp8_any_tiles_match_reference(
    device: torch.device, tiles: tuple[int, ...]
) -> None:
    """The tile shapes and program orders a sweep tries (``tiles``) give the reference's
    output too (30 pairs an expert: a 128-row block mostly padding; H and I off the 128
    grid; a row-block group of 3 leaves a partial group at the end)."""
    x, w13, w2, weights, ids = _problem(40, 4, 3, 200, 136, seed=9)
    args = [a.to(device) for a in (*quantize_fp8_experts(w13, w2), weights, ids)]
    out = fused_experts_fp8(x.to(device), *args, tiles=tiles)
    ref = fused_experts_fp8_reference(x.to(device), *args)
    assert _rel(out, ref) < (1e-5 if device.type == "cpu" else 1e-2)


def test_fused_experts_fp8_chunks_long_batches(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_moe_fp8, "CHUNK_TOKENS", 4)
    x, w13, w2, weights, ids = _problem(10, 4, 2, 128, 64, seed=5)
    args = [a.to(device) for a in (*quantize_fp8_experts(w13, w2), weights, ids)]
    out = fused_experts_fp8(x.to(device), *args)
    assert _rel(out, fused_experts_fp8_reference(x.to(device), *args)) < 1e-2


def test_fp8_expert_layout_round_trip_and_refusals(device: torch.device) -> None:
    x, w13, w2, weights, ids = _problem(2, 2, 1, 130, 40, seed=0)
    q13, s13, q2, s2 = quantize_fp8_experts(w13, w2)
    d13, d2 = dequantize_fp8_experts(q13, s13, q2, s2)
    assert _rel(d13, w13) < 0.07 and _rel(d2, w2) < 0.07
    args = [a.to(device) for a in (q13, s13, q2, s2, weights, ids)]
    xd = x.to(device)
    with pytest.raises(ValueError, match=r"w13_scale_inv is .* expected float32 \(2, 2, 2\)"):
        fused_experts_fp8(xd, args[0], args[1][:, :1], *args[2:])
    with pytest.raises(ValueError, match="needs float8_e4m3fn weights"):
        fused_experts_fp8(xd, args[0].float(), *args[1:])


def test_routed_experts_fp8_dispatch(device: torch.device) -> None:
    """The layer's FP8 weights, loaded through its per-expert views, give the same output
    on its kernel path as on its reference path (and its bytes are half of bf16's)."""
    t, e, k, h, inter = 6, 4, 2, 128, 64
    x, w13, w2, weights, ids = _problem(t, e, k, h, inter, seed=3)
    with torch.device(device):
        layer = RoutedExperts(e, h, inter, torch.bfloat16)
    bf16_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    layer.use_fp8()
    assert layer.w13.dtype == FP8_DTYPE and layer.w2.dtype == FP8_DTYPE
    fp8_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert fp8_bytes < 0.51 * bf16_bytes
    for ex in range(e):  # what the loader does: one HF tensor per view
        q13, s13, q2, s2 = quantize_fp8_experts(w13[ex : ex + 1], w2[ex : ex + 1])
        hf = {
            "gate_proj.weight": q13[0, :inter],
            "up_proj.weight": q13[0, inter:],
            "down_proj.weight": q2[0],
            "gate_proj.weight_scale_inv": s13[0, :1],
            "up_proj.weight_scale_inv": s13[0, 1:],
            "down_proj.weight_scale_inv": s2[0],
        }
        views = layer.expert_views(ex)
        assert views.keys() == hf.keys()
        for name, view in views.items():
            view.copy_(hf[name])
    xd, wd, idd = x.to(torch.bfloat16).to(device), weights.to(device), ids.to(device)
    outs = []
    for fused in (False, True):
        layer.fused = fused
        outs.append(layer(xd, wd, idd))
    assert _rel(outs[1], outs[0]) < 2e-2
    full = quantize_fp8_experts(w13, w2)
    torch.testing.assert_close(layer.w13_scale_inv.cpu(), full[1])


def test_fp8_glm5_experts_on_the_kernel_match_the_reference_path(
    tmp_path: Path, device: torch.device
) -> None:
    """An FP8 tiny GLM-5 (two layers, one MoE) gives the same logits with its routed
    experts on the FP8 kernel as on the reference path: a prompt, then a decode step."""
    ckpt = make_checkpoint(
        "GlmMoeDsaForCausalLM", "tiny", tmp_path, seed=3, dtype="float32",
        config_overrides={"num_hidden_layers": 2}, quantization="fp8",
    )  # fmt: skip
    models = [load_model(ckpt, "float32", device)[0] for _ in range(2)]
    routed = [m for m in models[1].modules() if isinstance(m, RoutedExperts)]
    assert routed and all(r.fp8 for r in routed)
    for r in routed:
        r.fused = True
    kvs = [PagedKV(m, 1, 32) for m in models]
    ids = torch.arange(3, 23).to(device)
    for computed, new in ((0, 19), (19, 1)):
        logits = []
        for m, kv in zip(models, kvs, strict=True):
            with torch.no_grad(), kv.step([computed], [new]):
                pos = torch.arange(computed, computed + new, device=device)
                logits.append(m.compute_logits(m(ids[computed : computed + new], pos)))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
