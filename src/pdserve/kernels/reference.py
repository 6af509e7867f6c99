"""Plain-torch references of the fused kernels, and what the layers run without them.

This module imports torch only (never triton), so layers and the sampler use these
functions on machines without Triton, and every kernel module imports its reference
from here: one floor down, no cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; statistics in float32, the normalised value cast
    back to the input dtype before the weight multiply (Hugging Face Llama's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] by per-token ``cos``/``sin`` [T, D/2] (half-rotation layout).

    Same arithmetic as HF's ``x * cos + rotate_half(x) * sin`` element for element.
    """
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] where dimensions (2i, 2i+1) form pair i (GPT-J /
    DeepSeek layout), by ``cos``/``sin`` [T, D/2]. The output holds the rotated even
    dimensions, then the rotated odd ones (HF's ``apply_rotary_pos_emb_interleave``):
    a fixed permutation of the GPT-J output, so dot products between two rotated
    vectors are the same, and both ends of a KV transfer agree on it."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` with torch ops."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) set with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        sorted_logits = sorted_logits.masked_fill(cum > top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)


# ---------------------------------------------------------------- block-scaled FP8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_GROUP = 128  # activation group and weight block width along K
_MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8_e4m3fn (torch's plain cast turns overflow into NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def write_paged(
    cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float = 1.0
) -> None:
    """``cache[slots] = values`` along dim 0, cast to the cache dtype; an fp8 cache stores
    ``values / scale`` (in float32), saturated, through a byte view (CPU torch has no fp8
    ``index_copy_``). ``scale`` is ignored for other dtypes."""
    if cache.dtype == FP8_DTYPE:
        if scale != 1.0:
            values = values.float() / scale
        cache.view(torch.uint8).index_copy_(0, slots, to_fp8(values).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values.to(cache.dtype))


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's K/V into the paged cache ([2, blocks, block, heads, dim]), cast
    to its dtype (an fp8 cache: ``k / k_scale`` and ``v / v_scale``, saturated at +-448)."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    t = slot_mapping.shape[0]
    write_paged(kv_cache[0].view(-1, num_kv_heads, head_dim), slot_mapping, k[:t], k_scale)
    write_paged(kv_cache[1].view(-1, num_kv_heads, head_dim), slot_mapping, v[:t], v_scale)


def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] → (fp8 [N, K], ``scale_inv`` float32 [ceil(N/bn), ceil(K/bk)]) with one
    scale per ``block`` (partial edge blocks allowed), ``w ≈ q * scale_inv`` block by block."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.view(nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [nb, kb]
    q = to_fp8(tiles / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return q.contiguous(), scale


def dequantize_fp8_blocks(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks` for ``block`` (rows, columns) per scale."""
    n, k = q.shape
    bn, bk = block
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * full).to(dtype)


def quantize_fp8_groups(
    x: torch.Tensor, group: int = FP8_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-``group``-channel quantization of activations ``x`` [M, K]:
    (fp8 [M, K], scales float32 [M, ceil(K/group)]), ``x ≈ q * scale`` group by group."""
    m, k = x.shape
    kb = -(-k // group)
    padded = x.new_zeros(m, kb * group, dtype=torch.float32)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, group)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = to_fp8(groups / scale[..., None]).view(m, kb * group)[:, :k]
    return q.contiguous(), scale


@dataclass(frozen=True)
class Fp8Activation:
    """An activation already quantized per token per 128 channels, as its producer (a
    norm or SiLU-and-mul in fp8 output mode) wrote it: ``q`` [..., K] float8_e4m3fn and
    ``scale`` float32 [..., ceil(K/128)] with ``x ≈ q * scale`` group by group, the values
    :func:`quantize_fp8_groups` gives for the ``dtype`` activation the producer would
    otherwise return. A block-FP8 linear consumes it without quantizing again. ``hp``:
    that ``dtype`` output as well, where a producer also feeds consumers that read it (the
    MoE router, the DSA indexer) beside FP8 ones; None otherwise."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype  # the producer's (and the consumer's output) dtype
    hp: torch.Tensor | None = None

    @classmethod
    def empty(
        cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, keep_hp: bool = False
    ) -> Fp8Activation:
        """Uninitialised buffers for a producer to write: ``q`` of ``shape``, its group
        scales, and with ``keep_hp`` the ``dtype`` output too."""
        q = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        groups = -(-shape[-1] // FP8_GROUP)
        scale = torch.empty((*shape[:-1], groups), dtype=torch.float32, device=device)
        hp = torch.empty(shape, dtype=dtype, device=device) if keep_hp else None
        return cls(q, scale, dtype, hp)

    def rows(self, start: int, stop: int) -> Fp8Activation:
        """Rows ``start:stop`` of a 2-D activation (views)."""
        hp = self.hp[start:stop] if self.hp is not None else None
        return Fp8Activation(self.q[start:stop], self.scale[start:stop], self.dtype, hp)

    def high_precision(self) -> torch.Tensor:
        """``hp``; a producer that was not asked to keep it is a bug in the wiring."""
        if self.hp is None:
            raise RuntimeError("this Fp8Activation carries no high-precision output")
        return self.hp

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * scale`` group by group, [..., K] in ``dtype``."""
        k = self.q.shape[-1]
        q2 = self.q.reshape(-1, k)
        s2 = self.scale.reshape(q2.shape[0], -1)
        return dequantize_fp8_blocks(q2, s2, (1, FP8_GROUP), dtype).view(self.q.shape)


def quantize_fp8_activation(x: torch.Tensor, keep_hp: bool = False) -> Fp8Activation:
    """``x`` [..., K] as an :class:`Fp8Activation` (:func:`quantize_fp8_groups` per row;
    ``keep_hp``: with ``x`` itself as ``hp``)."""
    k = x.shape[-1]
    q, s = quantize_fp8_groups(x.reshape(-1, k))
    scale = s.view(*x.shape[:-1], s.shape[-1])
    return Fp8Activation(q.view(x.shape), scale, x.dtype, x if keep_hp else None)


def block_fp8_matmul_reference(
    x: torch.Tensor | Fp8Activation,
    w_q: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    scale_rows: int = FP8_GROUP,
) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``x`` [..., K] quantized per token per 128 channels and ``W``
    block-quantized (``w_q`` [N, K] fp8, ``w_scale_inv`` [ceil(N/scale_rows), ceil(K/128)]
    as :func:`quantize_fp8_blocks` gives it); both dequantized, one float32 matmul, cast to
    ``out_dtype`` (default: ``x``'s dtype). The reference every FP8 GEMM is tested against.
    An :class:`Fp8Activation` ``x`` is only dequantized (its producer quantized it the
    same way), so both forms of one activation give the same result."""
    lead, k, dtype = x.shape[:-1], x.shape[-1], x.dtype
    if isinstance(x, Fp8Activation):  # quantized by its producer: dequantize only
        x_deq = x.dequantize().reshape(-1, k)
    else:
        x_q, x_scale = quantize_fp8_groups(x.reshape(-1, k))
        x_deq = dequantize_fp8_blocks(x_q, x_scale, (1, FP8_GROUP))
    out = x_deq @ dequantize_fp8_blocks(w_q, w_scale_inv, (scale_rows, FP8_GROUP)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or dtype).view(*lead, w_q.shape[0])


# ---------------------------------------------------------------- block-FP8 routed experts
def _dequantize_stack(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``q`` [E, N, K] fp8 with 128x128 block scales [E, ceil(N/128), ceil(K/128)] -> float32."""
    n, k = q.shape[1:]
    full = scale_inv.float().repeat_interleave(FP8_GROUP, 1)[:, :n]
    return q.float() * full.repeat_interleave(FP8_GROUP, 2)[:, :, :k]


def quantize_fp8_experts(
    w13: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked experts ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I]
    -> (w13 fp8, w13_scale_inv, w2 fp8, w2_scale_inv) in the FP8 expert layout of
    :mod:`pdserve.kernels.fused_moe_fp8`: every expert's gate, up and down projections
    quantized on their own 128x128 grids (as a checkpoint stores them), the gate's scale
    rows then the up's stacked in ``w13_scale_inv`` [E, 2 * ceil(I/128), ceil(H/128)]."""
    inter = w13.shape[1] // 2
    block = (FP8_GROUP, FP8_GROUP)
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (gq, gs), (uq, us) = (quantize_fp8_blocks(w, block) for w in w13[e].split(inter))
        dq, ds = quantize_fp8_blocks(w2[e], block)
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        q2.append(dq)
        s2.append(ds)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def dequantize_fp8_experts(
    w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor, w2_scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`quantize_fp8_experts`: float32 ``w13`` [E, 2I, H] and ``w2`` [E, H, I]."""
    inter = w13.shape[1] // 2
    nbi = w13_scale_inv.shape[1] // 2
    gate = _dequantize_stack(w13[:, :inter], w13_scale_inv[:, :nbi])
    up = _dequantize_stack(w13[:, inter:], w13_scale_inv[:, nbi:])
    return torch.cat([gate, up], dim=1), _dequantize_stack(w2, w2_scale_inv)


def _fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] quantized per token per 128 channels and dequantized (float32)."""
    q, s = quantize_fp8_groups(x)
    return dequantize_fp8_blocks(q, s, (1, FP8_GROUP))


def fused_experts_fp8_reference(
    x: torch.Tensor | Fp8Activation,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Routed experts with FP8 weights, dequantize-then-compute: what
    :func:`~pdserve.kernels.fused_moe_fp8.fused_experts_fp8` computes, in float32 torch.

    ``x`` [T, H] and the float32 ``silu(gate) * up`` activations are quantized per token
    per 128 channels (the kernel stores the latter in fp8 with their scales); the weights are
    dequantized per call. Every expert runs over every token and unchosen ones weigh 0
    (static shapes, no host sync: graph-capturable; the cost is E/k times the routed
    work, acceptable for the reference path). Returns [T, H] in ``x``'s dtype. An
    :class:`Fp8Activation` ``x`` is only dequantized (quantized already, the same way)."""
    t, h = x.shape
    w13f, w2f = dequantize_fp8_experts(w13, w13_scale_inv, w2, w2_scale_inv)
    num_experts, inter = w2f.shape[0], w2f.shape[2]
    xq = x.dequantize() if isinstance(x, Fp8Activation) else _fake_quantize_groups(x)
    gate, up = torch.einsum("th,enh->etn", xq, w13f).chunk(2, dim=-1)
    act = (F.silu(gate) * up).reshape(num_experts * t, inter)
    act = _fake_quantize_groups(act).view(num_experts, t, inter)
    y = torch.einsum("eti,ehi->eth", act, w2f)  # [E, T, H]
    dense = torch.zeros(t, num_experts, dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids.long(), weights.float())
    per_pair = (y * dense.t().unsqueeze(-1)).to(x.dtype)  # the kernel's per-pair rows
    return per_pair.float().sum(dim=0).to(x.dtype)
