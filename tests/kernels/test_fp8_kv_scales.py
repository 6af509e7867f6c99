"""Per-layer scales of the FP8 KV cache on every path that writes or reads it: the cache
write kernel, the Triton GQA backend (decode, speculative verify, prefill over a cached
prefix, and the SDPA prompt path that reads no cache), the Triton MLA backend, and a tiny
Llama end to end, each against the torch reference and against a float32 cache.

"Loud" K/V reach ~4x beyond e4m3's +-448 (the softmax scale shrinks to keep scores
ordinary): with ``scale = amax / 448`` an fp8 cache stays within a few percent of the
float32 one, while scale 1.0 saturates them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _paged import make_paged
from _sparse_batch import sparse_batch

from _kv_scaled import decode_logits, loud_kv_checkpoint
from _pd_engines import PROMPTS
from pdserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from pdserve.kernels.reference import FP8_DTYPE, FP8_MAX, to_fp8
from pdserve.layers.attention.mla import MLATorchBackend
from pdserve.layers.attention.mla_triton import MLATritonBackend
from pdserve.layers.attention.torch_ref import TorchReferenceBackend
from pdserve.layers.attention.triton_backend import TritonAttentionBackend
from pdserve.models import load_model

LOUD = 600.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error (a row that attends to one key shows a single value's e4m3
    rounding, up to 1/16, in the largest difference)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_scaled_write_round_trips_values_beyond_448(device: torch.device) -> None:
    g = torch.Generator().manual_seed(2)
    k = torch.randn(6, 2, 16, generator=g) * LOUD
    v = torch.randn(6, 2, 16, generator=g) * 0.01  # tiny: a scale below 1 keeps its bits
    k[0, 0, 0] = 3000.0
    slots = torch.tensor([5, 9, -1, 17, 2, 30])
    ks, vs = 3000.0 / FP8_MAX, 0.05 / FP8_MAX
    for write in (write_kv_cache, write_kv_cache_reference):
        for scales, ok in (((ks, vs), True), ((1.0, 1.0), False)):
            cache = torch.zeros(2, 4, 8, 2, 16, dtype=FP8_DTYPE, device=device)
            write(k.to(device), v.to(device), cache, slots.to(device), *scales)
            flat = cache.float().view(2, -1, 2, 16)
            keep = slots >= 0
            back_k = flat[0, slots[keep]].cpu() * scales[0]
            back_v = flat[1, slots[keep]].cpu() * scales[1]
            # e4m3: 3 mantissa bits, at most 1/16 relative error (plus its subnormal floor)
            close_k = bool(((back_k - k[keep]).abs() <= k[keep].abs() / 16 + 1e-3 * ks).all())
            close_v = bool(((back_v - v[keep]).abs() <= v[keep].abs() / 16 + 1e-3 * vs).all())
            assert close_k == close_v == ok, (write.__name__, scales)
            if not ok:
                assert float(back_k.max()) == FP8_MAX  # 3000 saturated at 448


BATCHES = {
    "decode": ([37, 20], [1, 1]),
    "verify": ([37, 20], [3, 3]),
    "prefix_prefill": ([40, 19], [9, 19]),
    "prompt": ([29], [29]),
}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_triton_gqa_applies_the_scales_once_on_every_path(device: torch.device, kind: str) -> None:
    seq_lens, q_lens = BATCHES[kind]
    pb = make_paged(seq_lens, q_lens, 2, 16, 16, torch.float32, device, seed=4)
    md = pb.common(device)
    t = md.num_actual_tokens
    g = torch.Generator().manual_seed(5)
    q = torch.randn(t, 4, 16, generator=g).to(device)
    k, v = (torch.randn(t, 2, 16, generator=g).to(device) * LOUD for _ in range(2))
    cache = pb.kv_cache * LOUD
    ks = float(torch.cat([cache[0].flatten(), k.flatten()]).abs().max()) / FP8_MAX
    vs = float(torch.cat([cache[1].flatten(), v.flatten()]).abs().max()) / FP8_MAX
    sm = 0.25 / LOUD  # ordinary scores for loud keys

    def run(be: object, c: torch.Tensor, scales: tuple[float, float]) -> torch.Tensor:
        return be.forward(q, k, v, c, be.build_metadata(md), sm, *scales)  # type: ignore[attr-defined]

    ref = run(TorchReferenceBackend(), cache.clone(), (1.0, 1.0))  # a float32 cache
    fp8 = torch.stack([to_fp8(cache[0] / ks), to_fp8(cache[1] / vs)])  # the prefix, as written
    torch_out = run(TorchReferenceBackend(), fp8.clone(), (ks, vs))
    tri_cache = fp8.clone()
    tri = run(TritonAttentionBackend(sdpa_prefill=False), tri_cache, (ks, vs))
    assert tri_cache.dtype == FP8_DTYPE
    assert _rel(tri, torch_out) < 1e-4 and _err(tri, ref) < 0.05
    plain = run(TritonAttentionBackend(sdpa_prefill=False), to_fp8(cache), (1.0, 1.0))
    assert _err(plain, ref) > 4 * _err(tri, ref)
    if kind == "prompt":  # SDPA attends over this step's unquantized K/V: no scale at all
        sdpa = run(TritonAttentionBackend(sdpa_prefill=True), fp8.clone(), (ks, vs))
        assert _rel(sdpa, ref) < 1e-5


def test_triton_mla_applies_the_scale_once(device: torch.device) -> None:
    h, lat, rope, page = 8, 48, 8, 4
    g = torch.Generator().manual_seed(7)
    sb = sparse_batch([6, 37, 21], [2, 2, 2], page, g, device)
    t = sb.md.num_actual_tokens
    latent = torch.randn(t, lat, generator=g).to(device) * LOUD
    k_pe = torch.randn(t, rope, generator=g).to(device) * LOUD
    q_lat = torch.randn(t, h, lat, generator=g).to(device) / LOUD
    q_pe = torch.randn(t, h, rope, generator=g).to(device) / LOUD
    topk = sb.random_topk(16, g)
    prefix = torch.randn(sb.num_blocks, page, lat + rope, generator=g).to(device) * LOUD
    s = float(torch.cat([prefix.flatten(), latent.flatten(), k_pe.flatten()]).abs().max())
    s /= FP8_MAX

    def run(be: object, c: torch.Tensor, kv_scale: float) -> torch.Tensor:
        return be.forward(q_lat, q_pe, latent, k_pe, c, sb.md, 0.2, topk, kv_scale)  # type: ignore[attr-defined]

    ref = run(MLATorchBackend(), prefix.clone(), 1.0)
    torch_out = run(MLATorchBackend(), to_fp8(prefix / s), s)
    tri = run(MLATritonBackend(max_model_len=64), to_fp8(prefix / s), s)
    assert _rel(tri, torch_out) < 1e-4 and _err(tri, ref) < 0.05
    plain = run(MLATritonBackend(max_model_len=64), to_fp8(prefix), 1.0)
    assert _err(plain, ref) > 4 * _err(tri, ref)


def test_tiny_llama_with_checkpoint_scales_on_the_triton_backend(
    tiny_llama: Path, tmp_path: Path, device: torch.device
) -> None:
    """A prompt (SDPA), a chunk over its prefix (prefill kernel), a verify-shaped step of
    3 tokens (decode kernel): the Triton backend over the fp8 cache stays as close to the
    float32 cache as the torch reference does (the SDPA prompt step attends over
    unquantized K/V, so the two fp8 runs differ by a little more than rounding). On the
    kernel tests' device: the compiled kernels on CUDA, the interpreter on a CPU."""
    loud_kv_checkpoint(tiny_llama, tmp_path / "loud", 2000.0)
    model, _ = load_model(tmp_path / "loud", "float32", device)
    ids, steps = PROMPTS[3][:16], [8, 5, 3]
    ref = decode_logits(model, ids, False, steps, "torch")
    torch_fp8 = decode_logits(model, ids, True, steps, "torch")
    tri_fp8 = decode_logits(model, ids, True, steps, "triton")
    assert _rel(tri_fp8, ref) < 0.05 and _rel(torch_fp8, ref) < 0.05
    assert _rel(tri_fp8, torch_fp8) < 0.05
