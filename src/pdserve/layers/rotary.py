"""Rotary position embedding (Su et al., 2021).

Two layouts: half-rotation ("neox", HF Llama), where dimension ``i < D/2`` is paired
with dimension ``i + D/2``; and interleaved (GPT-J, DeepSeek's MLA, GLM-5), where
dimensions ``2i`` and ``2i+1`` form a pair (:func:`~pdserve.kernels.reference.
apply_rotary_interleaved`). Either way pair ``i`` is rotated by ``position * inv_freq[i]``.
Frequencies: plain, linear, llama3 or YaRN (DeepSeek-V3) scaling. The cos/sin tables are computed once,
in float32 on the CPU (so every device and every instance of a P/D pair gets
bit-identical tables), for positions ``[0, max_position)``, cast to the model
dtype exactly as HF casts them, and moved to the default device. The forward only
indexes them by ``positions``: no host sync, no data-dependent control flow.
Positions outside the table are the caller's bug (the runner bounds them by
``max_model_len``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels.reference import apply_rotary, apply_rotary_interleaved
from pdserve.layers.fused import use_fused_kernels

# RoPE types this module implements ("default" means no scaling).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``linear`` uses ``factor``; ``llama3`` adds the two
    frequency factors and ``original_max_position_embeddings``; ``yarn`` (Peng et al.,
    2023) adds ``beta_fast``/``beta_slow`` and the attention factors, as HF computes them."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for every other type)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_get_mscale(scaling.factor, scaling.mscale) / _yarn_get_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _yarn_get_mscale(scaling.factor)


def yarn_softmax_mscale(scaling: RopeScaling | None) -> float:
    """DeepSeek's MLA multiplies its softmax scale by ``mscale(factor, mscale_all_dim)**2``
    under a scaled RoPE (HF ``yarn_apply_mscale``)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_get_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32, CPU), with optional linear / llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}; supported: {ROPE_TYPES}")


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: extrapolate high frequencies, interpolate low ones by ``factor``, with a
    linear ramp between the correction dimensions of ``beta_fast`` and ``beta_slow``."""
    original = s.original_max_position_embeddings
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    if s.low_freq_factor is None or s.high_freq_factor is None:
        raise ValueError("llama3 rope scaling needs low_freq_factor and high_freq_factor")
    if s.original_max_position_embeddings is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables; ``forward(positions)`` gathers this step's rows.

    Buffers are non-persistent (never in a checkpoint): ``cos_cache`` and
    ``sin_cache`` of shape [max_position, head_dim/2] in ``dtype``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]
        device = torch.get_default_device()
        factor = rope_attention_factor(scaling)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos_cache", cos.to(dtype).to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype).to(device), persistent=False)
        self.fused = use_fused_kernels(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, head_dim/2], for the flat ``positions`` [T]."""
        return self.cos_cache[positions], self.sin_cache[positions]

    def prepare(self, positions: torch.Tensor) -> RopeInputs:
        """Per-forward inputs shared by every layer: the torch path gathers cos/sin once;
        the fused kernel gathers them itself from the tables."""
        if self.fused:
            return RopeInputs(self, positions, None, None)
        cos, sin = self(positions)
        return RopeInputs(self, positions, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


@dataclass
class RopeInputs:
    rope: RotaryEmbedding
    positions: torch.Tensor
    cos: torch.Tensor | None  # None on the fused path
    sin: torch.Tensor | None

    @property
    def fused(self) -> bool:
        """Whether the fused kernels are on: they read the tables by position themselves
        (and may fuse the rotation with what follows it, e.g. a cache write)."""
        return self.cos is None or self.sin is None

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D]; the fused kernel works in place."""
        if self.cos is None or self.sin is None:
            from pdserve.kernels.rope import apply_rope

            r = self.rope
            return apply_rope(q, k, self.positions, r.cos_cache, r.sin_cache, r.head_dim)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def apply(self, x: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """Rotate one tensor x [T, heads, D] out of place, in either layout (the torch
        path: MLA and the DSA indexer rotate only part of their heads)."""
        cos, sin = self.cos, self.sin
        if cos is None or sin is None:
            cos, sin = self.rope(self.positions)
        if interleaved:
            return apply_rotary_interleaved(x, cos, sin)
        return apply_rotary(x, cos, sin)
