"""The Triton MLA backend (``--attention-backend triton``, or ``auto`` on CUDA).

Same cache layout and forward contract as :class:`~pdserve.layers.attention.mla.MLATorchBackend`
(either reads a cache the other wrote): write this step's latents and rotated keys
through the slot mapping, then one :func:`~pdserve.kernels.sparse_mla.sparse_mla_attention`
launch (plus its split combine) for every token of the step, whatever the batch shape:
sparse over each token's top-k where its request's context is longer than ``index_topk``,
dense over the causal context otherwise (and always without an indexer).

Graph safety: the launch shape comes from host ints only (tokens, heads, and the split
count from the top-k width or the static ``max_model_len``); the dense/sparse choice is
made per token on the device. Rows past ``num_actual_tokens`` (graph padding) are zeros.

Prefill (``prefill_variant``, default :data:`PREFILL_VARIANT`): a step with an indexer
and a query chunk of at least ``prefill_min_tokens`` tokens (or, with
``rows_min_tokens`` set, any step of that many rows: large decode and verify batches,
graph-safe since the launches depend on the row count only) resolves each token's
candidate cache rows once (:func:`~pdserve.kernels.sparse_mla_prefill.candidate_rows`)
and runs :func:`~pdserve.kernels.sparse_mla_prefill.sparse_mla_prefill` instead (same
keys, same result); other decode and verify steps keep the general kernel. The default is
the warp-specialized Gluon kernel (``gluon_ws``, :mod:`pdserve.kernels.sparse_mla_gluon_ws`)
where it applies (a Hopper GPU, a 16-bit cache, its widths; the plain Gluon kernel for other
widths) and the Triton variant ``DEFAULT_VARIANT`` elsewhere: the H200 sweep's best
(``prefill_sweep.py --sections mla_variants``: a 16K prefill layer in 10.7 ms with
``gluon_ws``, 54% of the bf16 matmul rate, 14.8 ms with the plain Gluon kernel, 26.3 ms with
``rows_n32_s5``, 33.4 ms with the general kernel, RESULTS.md run 50; in run 46 128 decode
rows at 16K took 0.16 / 0.24 / 0.30 ms with the plain Gluon / rows_n32_s5 / general
kernels, 64 x 4 verify rows 0.28 / 0.45 / 0.58 ms; outputs equal), hence
:data:`ROWS_MIN_TOKENS` 128.

An fp8 cache's scale (``kv_scale``) divides the row written and multiplies the kernel's
softmax scale and its output (the latent is the value too): no kernel argument of its own.
The Gluon kernels read a 16-bit cache only, so a prefill step over an fp8 cache (not under
graph capture) first copies the blocks of its requests into a 16-bit buffer
(:func:`dequantized_blocks`: ``nreq * blocks`` rows of the step's block table, one gather,
~20 MB a layer for a 16K prompt) and reads that, with a block table numbering those copies;
the values are the fp8 ones, so the result is the same as the Triton kernel's over the
fp8 cache (H100 run 77: the 8K FP8 prefill spent 199 ms in the Triton kernel against 64 ms
of ``gluon_ws`` in bf16). Past ``DEQUANT_MAX_ROWS`` rows (a prompt chunk batched with
long decodes) the Triton kernel reads the fp8 cache.
"""

from __future__ import annotations

import torch

from pdserve.kernels import sparse_mla_gluon
from pdserve.kernels._utils import num_sms
from pdserve.kernels.reference import write_paged
from pdserve.kernels.sparse_mla import choose_splits, sparse_mla_attention
from pdserve.kernels.sparse_mla_prefill import (
    DEFAULT_VARIANT,
    VARIANTS,
    candidate_rows,
    sparse_mla_prefill,
)
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata

# a sparse_mla_prefill.VARIANTS or sparse_mla_gluon.VARIANTS name; None: off
PREFILL_VARIANT: str | None = "gluon_ws"
PREFILL_MIN_TOKENS = 256  # steps with a query chunk this long take the prefill kernel
# decode / verify steps of at least this many rows take it too (None: never)
ROWS_MIN_TOKENS: int | None = 128
DEQUANT_MAX_ROWS = 1 << 17  # cache rows a prefill may copy to 16 bits (at 576 wide: 151 MB)


def dequantized_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks of ``block_tables`` [R, N] copied out of ``cache`` [blocks, page, D] in
    ``dtype``, a block table [R, N] numbering the copies): the same rows for a kernel that
    reads a 16-bit cache only. Block ids are gathered as they are (0, the null block, for
    unused entries), so a request's rows keep their positions."""
    r, n = block_tables.shape
    ids = block_tables.reshape(-1).to(torch.int64)
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    copy = raw.index_select(0, ids).view(cache.dtype).to(dtype)
    local = torch.arange(r * n, dtype=block_tables.dtype, device=block_tables.device)
    return copy, local.view(r, n)


class MLATritonBackend(AttentionBackend):
    name = "mla_triton"
    supports_cuda_graphs = True

    def __init__(
        self,
        max_model_len: int | None = None,
        prefill_variant: str | None = PREFILL_VARIANT,
        prefill_min_tokens: int = PREFILL_MIN_TOKENS,
        rows_min_tokens: int | None = ROWS_MIN_TOKENS,
    ) -> None:
        names = sorted(VARIANTS) + sorted(sparse_mla_gluon.VARIANTS)
        if prefill_variant is not None and prefill_variant not in names:
            raise ValueError(f"prefill_variant {prefill_variant!r}: one of {names}")
        self.max_model_len = max_model_len
        self.prefill_variant = prefill_variant
        self.prefill_min_tokens = max(1, prefill_min_tokens)
        self.rows_min_tokens = rows_min_tokens

    def forward(
        self,
        q_lat: torch.Tensor,  # [T, H, L]
        q_pe: torch.Tensor,  # [T, H, R]
        latent: torch.Tensor | None,  # [T, L]; None (and k_pe): already in the cache
        k_pe: torch.Tensor | None,  # [T, R]
        cache: torch.Tensor,  # [blocks, block_size, L + R]
        md: CommonAttentionMetadata,
        scale: float,
        topk: torch.Tensor | None,  # [T, K] key positions, -1 for none
        kv_scale: float = 1.0,  # an fp8 cache's scale (1.0 for any other)
    ) -> torch.Tensor:  # [T, H, L]
        t = md.num_actual_tokens
        if latent is not None and k_pe is not None:  # None: the layer's prepare wrote them
            entry = torch.cat([latent[:t], k_pe[:t]], dim=-1)
            flat = cache.view(-1, cache.shape[-1])
            write_paged(flat, md.slot_mapping[:t], entry, kv_scale)  # fp8: / kv_scale, saturated
        out = torch.empty_like(q_lat)
        page = cache.shape[1]
        rows_step = self.rows_min_tokens is not None and t >= self.rows_min_tokens
        if (
            self.prefill_variant is not None
            and topk is not None
            and (md.max_query_len >= self.prefill_min_tokens or rows_step)
            and cache.stride(0) == page * cache.stride(1)
        ):
            keys, table = cache, md.block_tables
            if self._dequantize(cache, q_lat, q_pe, md):
                keys, table = dequantized_blocks(cache, table, q_lat.dtype)
            rows, ncand = candidate_rows(table, md.seq_lens, md.query_start_loc,
                                         md.token_req_idx, md.token_q_idx, topk, page, t)  # fmt: skip
            self._prefill(q_lat, q_pe.contiguous(), keys, rows, ncand, scale * kv_scale, t, out)
        else:
            self._general(q_lat, q_pe, cache, md, scale * kv_scale, topk, out)
        if kv_scale != 1.0:
            out[:t].mul_(kv_scale)
        if q_lat.shape[0] > t:
            out[t:].zero_()
        return out

    def _dequantize(self, cache: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor,
                    md: CommonAttentionMetadata) -> bool:  # fmt: skip
        """Whether this step reads a 16-bit copy of its blocks (see the module docstring):
        a prompt chunk over an fp8 cache, a Gluon variant that runs on the copy, not
        under graph capture, at most ``DEQUANT_MAX_ROWS`` rows."""
        table = md.block_tables
        if cache.element_size() != 1 or md.max_query_len < self.prefill_min_tokens:
            return False
        if table.numel() * cache.shape[1] > DEQUANT_MAX_ROWS:
            return False
        if self.prefill_variant not in sparse_mla_gluon.VARIANTS:
            return False
        if q_lat.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        return sparse_mla_gluon.supported(q_lat, q_pe, cache, cache_dtype=q_lat.dtype)

    def _prefill(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 rows: torch.Tensor, ncand: torch.Tensor, scale: float, t: int,
                 out: torch.Tensor) -> None:  # fmt: skip
        v = self.prefill_variant or DEFAULT_VARIANT  # (forward calls it only when set)
        if v in sparse_mla_gluon.VARIANTS:
            if sparse_mla_gluon.supported(q_lat, q_pe, cache):
                sparse_mla_gluon.sparse_mla_prefill_gluon(q_lat, q_pe, cache, rows, ncand, scale,
                                                          t, out, v)  # fmt: skip
                return
            v = DEFAULT_VARIANT  # not Hopper, an fp8 cache or other widths: the Triton kernel
        sparse_mla_prefill(q_lat, q_pe, cache, rows, ncand, scale, t, out, v)

    def _general(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 md: CommonAttentionMetadata, scale: float, topk: torch.Tensor | None,
                 out: torch.Tensor) -> None:  # fmt: skip
        t = md.num_actual_tokens
        bound = topk.shape[1] if topk is not None else (self.max_model_len or md.max_seq_len)
        splits = choose_splits(t, q_lat.shape[1], bound, num_sms(q_lat.device), q_lat.shape[2])
        sparse_mla_attention(
            q_lat,  # strided rows are fine (the W_UK product's [H, T, L] layout)
            q_pe.contiguous(),
            cache,
            md.block_tables,
            md.seq_lens,
            md.query_start_loc,
            md.token_req_idx,
            md.token_q_idx,
            topk,
            scale,
            t,
            splits,
            out,
        )
