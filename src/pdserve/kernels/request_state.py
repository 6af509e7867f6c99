"""The request state's two per-step op chains in few launches
(:mod:`pdserve.runner.request_state`; their torch ops there are the references).

**post_update** (one launch, with a drafter; without one the state is only the last
tokens, one torch op in :meth:`RequestState.post_update
<pdserve.runner.request_state.RequestState.post_update>`). After a step samples and its
drafter proposes, each of its requests records in its ``InputBatch`` row: the last
accepted token, the accepted tokens and their count, the drafts proposed for the next
step (-1: none) and the computed-token count moved by the scheduled tokens less the
rejected drafts. A request that sampled nothing (a prompt chunk short of its end) writes
into the scratch row instead, except its computed count. One program per request; rows
are distinct within a step, so the computed count is a plain read-modify-write.

**place** (two launches; one without drafts). Before the next step's forward: the
scheduler's drafts are merged with the state's (-1: the state's, -2: none, stored as
-1), then one launch fills what only the device knows: the inputs that are a row's last
sampled token, the draft inputs (token 0 where there is none), and with a drafter the
positions, sequence lengths and slots from the device's computed counts. Its programs
split into four ranges by ``program_id`` (tokens, requests, last tokens, drafts); the
draft inputs read the merged drafts, which is why the merge is a launch of its own.

No host sync in either (CUDA-graph safe). Nothing a step's sizes set is a compile-time
constant or a specialisation (counts, widths, strides, pointer alignment): the variants
are the flags of :func:`post_update_variants` and place's drafting flag, all compiled by
:meth:`RequestState.warm_up <pdserve.runner.request_state.RequestState.warm_up>` at
start-up, so traffic compiles none of them.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, next_pow2, pdl_args, pdl_enter


def _runtime(fn: Any) -> Any:
    """``triton.jit`` that specialises none of ``fn``'s runtime (non-constexpr) arguments:
    no int on being 1 or a multiple of 16, no pointer on 16-byte alignment."""
    names = [
        n for n, p in inspect.signature(fn).parameters.items() if "constexpr" not in str(p.annotation)
    ]
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(fn)


@_runtime
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
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    sampled = tl.load(samples_ptr + b) != 0
    dst = tl.where(sampled, row, scratch)
    cnt = tl.load(num_ptr + b).to(tl.int64) if HAS_NUM else tl.full((), 1, tl.int64)
    last = tl.load(tokens_ptr + b * stride_tok + tl.maximum(cnt - 1, 0))
    tl.store(last_ptr + dst, last.to(tl.int64))
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


def post_update_variants() -> list[tuple[bool, bool, bool]]:
    """(num given, num_rows given, drafts given) of a call per compiled variant of
    :func:`post_update` (the row counts are read only with the accepted counts): one
    call each compiles them all."""
    both = (False, True)
    return [(n, r, d) for n, r, d in itertools.product(both, both, both) if n or not r]


def post_update(
    last_token: torch.Tensor,  # [R + 1] int64 (row R: scratch)
    sampled: torch.Tensor,  # [R + 1, S + 1] int64
    num_sampled: torch.Tensor,  # [R + 1] int64
    drafts_state: torch.Tensor,  # [R + 1, K] int64
    num_computed: torch.Tensor,  # [R + 1] int64
    scratch: int,
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
    assert w <= sampled.shape[1], (w, sampled.shape)
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
        BLOCK_W=next_pow2(sampled.shape[1]),  # the widest step, not this one's width
        BLOCK_K=next_pow2(max(k, 1)),
        num_warps=1,
        **pdl_args(rows.device),
    )


@_runtime
def _merge_drafts_kernel(
    drafts_ptr, rows_ptr, state_drafts_ptr, kd, stride_dr, stride_sd,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    ok = j < kd
    d = tl.load(drafts_ptr + b * stride_dr + j, mask=ok)
    s = tl.load(state_drafts_ptr + row * stride_sd + j, mask=ok)
    tl.store(drafts_ptr + b * stride_dr + j, tl.maximum(tl.where(d == -1, s, d), -1), mask=ok)


@_runtime
def _place_kernel(
    ids_ptr, pos_ptr, seq_ptr, slots_ptr, req_idx_ptr, q_idx_ptr, bt_ptr, rows_ptr,
    nsched_ptr, last_at_ptr, last_req_ptr, drafts_ptr, draft_at_ptr, draft_flat_ptr,
    last_tok_ptr, computed_ptr, num_tokens, num_reqs, num_last, num_drafts, kd, stride_bt,
    stride_dr, page, p_tok, p_req, p_last,
    DRAFTING: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if pid < p_tok:  # positions and slots from the device's computed counts
        t = pid * BLOCK + offs
        m = t < num_tokens
        r = tl.load(req_idx_ptr + t, mask=m, other=0)
        row = tl.load(rows_ptr + r, mask=m, other=0)
        pos = tl.load(computed_ptr + row, mask=m, other=0) + tl.load(q_idx_ptr + t, mask=m)
        tl.store(pos_ptr + t, pos, mask=m)
        blk = tl.load(bt_ptr + r * stride_bt + pos // page, mask=m, other=0).to(tl.int64)
        tl.store(slots_ptr + t, blk * page + pos % page, mask=m)
    elif pid < p_tok + p_req:  # sequence lengths
        b = (pid - p_tok) * BLOCK + offs
        m = b < num_reqs
        row = tl.load(rows_ptr + b, mask=m, other=0)
        seq = tl.load(computed_ptr + row, mask=m, other=0) + tl.load(nsched_ptr + b, mask=m)
        tl.store(seq_ptr + b, seq.to(tl.int32), mask=m)
    elif pid < p_tok + p_req + p_last:  # inputs that are a row's last sampled token
        i = (pid - p_tok - p_req) * BLOCK + offs
        m = i < num_last
        row = tl.load(rows_ptr + tl.load(last_req_ptr + i, mask=m, other=0), mask=m, other=0)
        tok = tl.load(last_tok_ptr + row, mask=m)
        tl.store(ids_ptr + tl.load(last_at_ptr + i, mask=m, other=0), tok, mask=m)
    else:  # draft inputs, from the merged drafts (-1: none, fed as token 0)
        i = (pid - p_tok - p_req - p_last) * BLOCK + offs
        m = i < num_drafts
        flat = tl.load(draft_flat_ptr + i, mask=m, other=0)
        d = tl.load(drafts_ptr + (flat // kd) * stride_dr + flat % kd, mask=m, other=0)
        tl.store(ids_ptr + tl.load(draft_at_ptr + i, mask=m, other=0), tl.maximum(d, 0), mask=m)


_PLACE_BLOCK = 128


def place(
    ids: torch.Tensor,  # [T'] int64: the step's input ids
    positions: torch.Tensor,  # [T'] int64
    seq_lens: torch.Tensor,  # [B'] int32
    slots: torch.Tensor,  # [T'] int64
    req_idx: torch.Tensor,  # [T'] int64
    q_idx: torch.Tensor,  # [T'] int64
    block_tables: torch.Tensor,  # [B', blocks] int32
    page: int,
    last_token: torch.Tensor,  # [R + 1] int64
    drafts_state: torch.Tensor,  # [R + 1, K] int64
    num_computed: torch.Tensor,  # [R + 1] int64
    drafting: bool,
    rows: torch.Tensor,  # [B]
    nsched: torch.Tensor,  # [B]
    num_tokens: int,
    last_at: torch.Tensor,  # [L]
    last_req: torch.Tensor,  # [L]
    drafts: torch.Tensor | None,  # [B, kd]: -1 from the state, -2 none (merged in place)
    draft_at: torch.Tensor | None,  # [D]
    draft_flat: torch.Tensor | None,  # [D]
) -> None:
    """What :meth:`RequestState.place` does with torch ops, in two launches (one without
    drafts): the drafts merged with the state's, then the inputs only the device knows
    (last tokens, drafts, and with a drafter positions, sequence lengths and slots)."""
    check_device(ids, "place")
    n = rows.shape[0]
    kd = 0
    if drafts is not None and n:
        kd = drafts.shape[1]
        _merge_drafts_kernel[(n,)](
            drafts, rows, drafts_state, kd, drafts.stride(0), drafts_state.stride(0),
            BLOCK_K=next_pow2(drafts_state.shape[1]), num_warps=1,
            **pdl_args(drafts.device),
        )  # fmt: skip
    nd = draft_at.shape[0] if draft_at is not None else 0
    blocks = [
        triton.cdiv(num_tokens, _PLACE_BLOCK) if drafting else 0,
        triton.cdiv(n, _PLACE_BLOCK) if drafting else 0,
        triton.cdiv(last_at.shape[0], _PLACE_BLOCK),
        triton.cdiv(nd, _PLACE_BLOCK),
    ]
    if not sum(blocks):
        return
    _place_kernel[(sum(blocks),)](
        ids, positions, seq_lens, slots, req_idx, q_idx, block_tables, rows, nsched,
        last_at, last_req, drafts if drafts is not None else ids,
        draft_at if draft_at is not None else last_at,
        draft_flat if draft_flat is not None else last_at,
        last_token, num_computed, num_tokens, n, last_at.shape[0], nd, max(kd, 1),
        block_tables.stride(0), drafts.stride(0) if drafts is not None else 0, page,
        blocks[0], blocks[1], blocks[2],
        DRAFTING=drafting, BLOCK=_PLACE_BLOCK, num_warps=4,
        **pdl_args(ids.device),
    )  # fmt: skip
