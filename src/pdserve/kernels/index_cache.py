"""The DSA indexer's key cache layouts, in torch only (never triton: the layers import
this at load time; see :mod:`pdserve.kernels`).

A model-dtype cache is ``[blocks, block_size, D]`` keys. An fp8 cache
(``--kv-cache-dtype fp8``) is one uint8 tensor ``[blocks, block_size * (D + 4)]``: a
block is its ``block_size`` float8_e4m3fn keys, then their float32 scales, one a key,
``k ≈ k_fp8 * scale`` with ``scale = max(amax(|k|) / 448, 1e-12)`` computed as the key
is written (dynamic, per token, as DeepSeek-V3.2 stores indexer keys). Keys and scales
sit apart so key rows stay 16-byte aligned (``D`` a multiple of 16) and a layer keeps
one tensor that transports move as bytes. :func:`indexer_cache_views` gives the two
strided views the kernels take (``cache`` and ``k_scale`` of
:mod:`~pdserve.kernels.dsa_indexer` and :mod:`~pdserve.kernels.dsa_indexer_tiled`).
"""

from __future__ import annotations

import torch

from pdserve.kernels.reference import FP8_DTYPE, quantize_fp8_groups

KEY_SCALE_BYTES = 4  # one float32 scale a key in an fp8 indexer cache


def fp8_index_row_bytes(head_dim: int) -> int:
    """Bytes a key takes in an fp8 indexer cache (its fp8 values and its scale)."""
    if head_dim % KEY_SCALE_BYTES:
        raise ValueError(f"an fp8 indexer cache needs index_head_dim % 4 == 0, not {head_dim}")
    return head_dim + KEY_SCALE_BYTES


def indexer_cache_views(
    cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keys [blocks, block_size, D], per-key float32 scales [blocks, block_size] or None)
    of one layer's indexer cache: a model-dtype cache is its keys (no scales); a uint8
    cache [blocks, block_size * (D + 4)] is the fp8 layout of the module doc, split into
    two views of the same storage (no copy)."""
    if cache.dtype != torch.uint8:
        return cache, None
    row = fp8_index_row_bytes(head_dim)
    if cache.dim() != 2 or cache.shape[1] % row or cache.stride(1) != 1:
        raise ValueError(f"fp8 indexer cache {tuple(cache.shape)} is not [blocks, page * {row}]")
    bs = cache.shape[1] // row
    keys = cache[:, : bs * head_dim].view(FP8_DTYPE).unflatten(1, (bs, head_dim))
    return keys, cache[:, bs * head_dim :].view(torch.float32)


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [T, D] -> (float8_e4m3fn [T, D], float32 scales [T]): one scale a key."""
    q, s = quantize_fp8_groups(k, group=k.shape[-1])
    return q, s[:, 0]


def write_index_keys(
    keys: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, k: torch.Tensor
) -> None:
    """Write keys ``k`` [n, D] to ``slots`` (all >= 0) of an indexer cache given as its
    :func:`indexer_cache_views` (``scales`` None: model-dtype keys; else fp8 keys, each
    quantized with its own scale as :func:`quantize_index_keys`)."""
    if scales is None:
        keys.view(-1, keys.shape[-1]).index_copy_(0, slots, k.to(keys.dtype))
        return
    kq, ks = quantize_index_keys(k)
    blk, off = slots // keys.shape[1], slots % keys.shape[1]
    keys.view(torch.uint8)[blk, off] = kq.view(torch.uint8)  # CPU torch: no fp8 index_put
    scales[blk, off] = ks


def quantize_index_queries(
    q: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [T, H, D] -> (float8_e4m3fn [T, H, D], ``weights * q_scale`` [T, H] float32)
    with one scale a (token, head), as DeepSeek-V3.2 scores: ``ReLU(q . k) * w = ReLU(q_fp8
    . k) * (w * q_scale)`` since ``q_scale > 0``. The score kernels take the pair in place
    of (q, weights) for FP8 MMAs over fp8 keys (the engine's indexer backends do so
    whenever their keys are fp8)."""
    t, h, d = q.shape
    q8, qs = quantize_fp8_groups(q.reshape(t * h, d), group=d)
    return q8.view(t, h, d), weights.float() * qs.view(t, h)


def dequantize_index_cache(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The keys of an indexer cache as float32 [blocks, block_size, D] (references, tests)."""
    keys, scales = indexer_cache_views(cache, head_dim)
    if scales is None:
        return keys.float()
    return keys.view(torch.uint8).view(FP8_DTYPE).float() * scales[..., None]


def check_key_cache(
    cache: torch.Tensor, k_scale: torch.Tensor | None, d: int, q_dtype: torch.dtype | None = None
) -> None:
    """Refuse a key cache the score kernels cannot read: [blocks, page, D] with unit inner
    stride; with ``k_scale``: fp8 keys and float32 scales [blocks, page], unit inner stride.
    Queries of ``q_dtype`` fp8 (:func:`quantize_index_queries`) need fp8 keys."""
    if cache.dim() != 3 or cache.shape[-1] != d or cache.stride(-1) != 1:
        raise ValueError(f"indexer cache {tuple(cache.shape)} is not [blocks, page, {d}] "
                         "with unit inner stride")  # fmt: skip
    if q_dtype == FP8_DTYPE and k_scale is None:
        raise ValueError("fp8 indexer queries need fp8 keys (k_scale)")
    if k_scale is None:
        if cache.dtype == FP8_DTYPE:
            raise ValueError("fp8 indexer keys need their per-key scales (k_scale)")
        return
    if (
        cache.dtype != FP8_DTYPE
        or k_scale.dtype != torch.float32
        or k_scale.shape != cache.shape[:2]
        or k_scale.stride(1) != 1
    ):
        raise ValueError(f"k_scale {k_scale.dtype} {tuple(k_scale.shape)} does not fit fp8 "
                         f"keys {cache.dtype} {tuple(cache.shape)}")  # fmt: skip
