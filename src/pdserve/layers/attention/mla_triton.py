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
            rows, ncand = candidate_rows(md.block_tables, md.seq_lens, md.query_start_loc,
                                         md.token_req_idx, md.token_q_idx, topk, page, t)  # fmt: skip
            self._prefill(q_lat, q_pe.contiguous(), cache, rows, ncand, scale * kv_scale, t, out)
        else:
            self._general(q_lat, q_pe, cache, md, scale * kv_scale, topk, out)
        if kv_scale != 1.0:
            out[:t].mul_(kv_scale)
        if q_lat.shape[0] > t:
            out[t:].zero_()
        return out

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
