"""The request state's ``post_update`` in one launch (:mod:`pdserve.runner.request_state`).

After a step samples (and its drafter proposes), each of its requests records in its
``InputBatch`` row: the last accepted token, and with a drafter also the accepted
tokens and their count, the drafts proposed for the next step (-1: none) and the
computed-token count moved by the scheduled tokens less the rejected drafts. A request
that sampled nothing (a prompt chunk short of its end) writes into the scratch row
instead, except its computed count. The torch reference is
:meth:`RequestState.post_update`'s op chain (about a dozen launches with a drafter);
here one program per request does all of it. Rows are distinct within a step, so the
computed count is a plain read-modify-write. No host sync (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, next_pow2


@triton.jit
def _post_update_kernel(
    rows_ptr,
    nsched_ptr,
    num_rows_ptr,
    samples_ptr,
    tokens_ptr,
    num_ptr,
    drafts_ptr,
    last_ptr,
    sampled_ptr,
    num_sampled_ptr,
    state_drafts_ptr,
    computed_ptr,
    scratch,
    w,
    k,
    stride_tok,
    stride_din,
    stride_sampled,
    stride_sdrafts,
    HAS_NUM: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    HAS_DRAFTS: tl.constexpr,
    DRAFTING: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    sampled = tl.load(samples_ptr + b) != 0
    dst = tl.where(sampled, row, scratch)
    cnt = tl.load(num_ptr + b).to(tl.int64) if HAS_NUM else tl.full((), 1, tl.int64)
    last = tl.load(tokens_ptr + b * stride_tok + tl.maximum(cnt - 1, 0))
    tl.store(last_ptr + dst, last.to(tl.int64))
    if DRAFTING:
        tl.store(num_sampled_ptr + dst, cnt)
        ow = tl.arange(0, BLOCK_W)
        mw = ow < w
        toks = tl.load(tokens_ptr + b * stride_tok + ow, mask=mw)
        tl.store(sampled_ptr + dst * stride_sampled + ow, toks.to(tl.int64), mask=mw)
        ok = tl.arange(0, BLOCK_K)
        mk = ok < k
        if HAS_DRAFTS:
            d = tl.load(drafts_ptr + b * stride_din + ok, mask=mk).to(tl.int64)
        else:
            d = tl.full((BLOCK_K,), -1, tl.int64)
        tl.store(state_drafts_ptr + dst * stride_sdrafts + ok, d, mask=mk)
        moved = tl.load(nsched_ptr + b).to(tl.int64)
        if HAS_ROWS:  # verified rows less the accepted: the rejected drafts
            nrows = tl.load(num_rows_ptr + b).to(tl.int64)
            moved -= tl.where(sampled, nrows - cnt, 0)
        tl.store(computed_ptr + row, tl.load(computed_ptr + row) + moved)


def post_update(
    last_token: torch.Tensor,  # [R + 1] int64 (row R: scratch)
    sampled: torch.Tensor,  # [R + 1, S + 1] int64
    num_sampled: torch.Tensor,  # [R + 1] int64
    drafts_state: torch.Tensor,  # [R + 1, K] int64
    num_computed: torch.Tensor,  # [R + 1] int64
    scratch: int,
    drafting: bool,
    rows: torch.Tensor,  # [B]
    nsched: torch.Tensor,  # [B]
    num_rows: torch.Tensor | None,  # [B] tokens verified; None: all 1
    samples: torch.Tensor,  # [B] bool
    tokens: torch.Tensor,  # [B, w] accepted tokens (-1 past the count)
    num: torch.Tensor | None,  # [B] accepted counts; None: all 1
    drafts: torch.Tensor | None,  # [B, >= K] proposed for the next step
) -> None:
    """Record a step in its rows (one launch); see the module docstring."""
    check_device(tokens, "post_update")
    n, w = tokens.shape
    if n == 0:
        return
    k = drafts_state.shape[1]
    _post_update_kernel[(n,)](
        rows,
        nsched,
        num_rows if num_rows is not None else nsched,
        samples,
        tokens,
        num if num is not None else nsched,
        drafts if drafts is not None else tokens,
        last_token,
        sampled,
        num_sampled,
        drafts_state,
        num_computed,
        scratch,
        w,
        k,
        tokens.stride(0),
        drafts.stride(0) if drafts is not None else 0,
        sampled.stride(0),
        drafts_state.stride(0),
        HAS_NUM=num is not None,
        HAS_ROWS=num_rows is not None and num is not None,
        HAS_DRAFTS=drafts is not None,
        DRAFTING=drafting,
        BLOCK_W=next_pow2(max(w, 1)),
        BLOCK_K=next_pow2(max(k, 1)),
        num_warps=1,
    )
