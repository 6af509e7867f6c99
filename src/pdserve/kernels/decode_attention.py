"""Paged decode attention for uniform batches (every request has ``q_len`` new tokens).

Batch shape: request ``b`` owns flat query rows ``b*q_len : (b+1)*q_len``; they are
the last ``q_len`` positions of its context of ``seq_lens[b]`` tokens (their K/V
are already in the cache) and attend causally: row ``i`` sees keys
``0 .. seq_lens[b] - q_len + i``. ``q_len`` is 1 for plain decode and ``1 + k``
for speculative verification.

Work split: program ``(b, kv_head, split)`` loads the ``q_len * group`` query rows
that share one KV head (group = num_heads / num_kv_heads) and streams that head's
K/V tiles through an online softmax, so each K/V byte is read once per KV group.
With more than two rows the scores are one ``tl.dot`` with the rows padded to 16
(tensor cores; decode is bandwidth-bound, so the padding costs nothing that
matters); with one or two rows (MHA decode) a broadcast multiply-sum is used.

Split-K: each request's context is cut into ``num_splits`` equal, tile-aligned
chunks computed *in the kernel* from ``seq_lens[b]``; each split writes its
normalised partial output and log-sum-exp to a workspace and a second kernel
combines them. ``num_splits`` comes from host information only (batch size, KV
heads, multiprocessor count and a static context bound, see
:func:`choose_num_splits`), never from device values, so the two launches are
CUDA-graph capturable; any ``num_splits`` gives the same result up to rounding.

Requests with ``seq_lens[b] == 0`` (graph padding) read nothing and output zeros.
The cache may be float8_e4m3fn: tiles are converted to fp16 for bf16 / fp16 queries
(``FP8_HALF``; else to the query dtype), and the caller folds the layer's static K scale
into ``scale`` and multiplies the output by V's.
Its speed against the copy bound, by batch and context, is in
``benchmarks/RESULTS.md`` ("Kernel measurements").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import (
    LOG2E,
    check_device,
    dot_precision,
    dot_upcast,
    e4m3_to_f16,
    interpret_mode,
    next_pow2,
    pdl_args,
    pdl_enter,
)
from pdserve.kernels.reference import FP8_DTYPE

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 64
CTAS_PER_SM = 4
# software-pipelining depth of the K/V tile loop (kernels_bench's decode_configs sweeps
# it). Over a bf16 cache two: alone at 1K context the engine's pick at batch 64 took
# 99.2 us with two stages and 92.1 with one (H100, RESULTS.md run 122), but in the
# llama-8b-shape decode step the kernel took 95.4 us a layer either way and the step the
# same time (run 123). Over an fp8 cache one (run 64: 104.5 against 75.5 us at batch 64).
NUM_STAGES = 2
NUM_STAGES_FP8 = 1
# Over an fp8 cache with bf16 / fp16 queries the MMAs take fp16 operands and the tiles
# are converted by the hardware's e4m3x2 -> f16x2 instruction in the layout they were
# loaded in (an opaque inline-asm op that Triton's layout pass cannot move past), instead
# of being shuffled byte by byte through shared memory first (64 LDS.U8 an iteration)
# and converted to bf16 by way of fp16. e4m3 -> fp16 is exact, and fp16 keeps more of
# q's and p's bits than bf16 (q is clamped to fp16's range). Compiled for sm_90a
# (tools/sm90_report.py, decode_fp8 against decode_fp8_bf16mma) the K/V loop drops from
# 855 to 461 SASS instructions an iteration (bf16 cache: 586 for twice the bytes): an
# fp8 tile holds half a bf16 tile's bytes, so the loop's instruction count weighs twice
# as much. H100, RESULTS.md run 103: 3-19% faster at 1-64 x 1K / 16K, 62-68% of the copy
# bound against 59-63% before (bf16 cache: 93%).
FP8_HALF = True


def num_stages(kv_cache: torch.Tensor) -> int:
    """The K/V tile loop's pipelining depth for this cache's element type."""
    return NUM_STAGES_FP8 if kv_cache.element_size() == 1 else NUM_STAGES


# One compile for every split count; the query length QL is a runtime value too (Triton
# still specialises QL == 1, plain decode), so a short prompt of a new length does not
# compile a kernel under traffic: only the tile config (BLOCK_M etc.) picks a variant.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    ws_o_ptr,
    ws_lse_ptr,
    qk_scale,
    num_splits,
    QL,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
    HALF: tl.constexpr = False,
    ASM: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    tok = rows // G
    head = kvh * G + rows % G
    row_ok = rows < QL * G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    t_idx = (b * QL + tok).to(tl.int64)
    q = tl.load(
        q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if HALF:  # fp8 cache: fp16 MMAs (q clamped to fp16's range)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_pos = seq_len - QL + tok  # absolute position of each row's token

    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        in_blk = offs_n % PAGE
        k_off = blk * stride_kb + in_blk * stride_ks + kvh * stride_kh
        v_off = blk * stride_vb + in_blk * stride_vs + kvh * stride_vh
        kt = tl.load(
            k_ptr + k_off[None, :] + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        # fp8 (its scale is in qk_scale) or bf16 upcast
        kt = e4m3_to_f16(kt, ASM) if HALF else kt.to(q.dtype)
        if USE_DOT:
            s = tl.dot(q, kt, input_precision=DOT_PREC)
        else:
            s = tl.sum(q.to(tl.float32)[:, :, None] * kt.to(tl.float32)[None, :, :], axis=1)
        s = s * qk_scale
        keep = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + v_off[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = e4m3_to_f16(v, ASM) if HALF else v.to(q.dtype)
        acc = acc * alpha[:, None]
        if USE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PREC)
        else:
            acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        row = t_idx * NUM_HEADS + head  # [BLOCK_M]: (token, head) row of the workspace
        tl.store(ws_lse_ptr + row * num_splits + sp, lse, mask=row_ok)
        ws = ws_o_ptr + (row[:, None] * num_splits + sp) * HEAD_D + offs_d[None, :]
        tl.store(ws, o, mask=row_ok[:, None] & d_ok[None, :])
    else:
        dst = out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every split count
def _reduce_kernel(
    ws_o_ptr,
    ws_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = t * NUM_HEADS + h
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    lse = tl.load(ws_lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    parts = tl.load(
        ws_o_ptr + (row * num_splits + offs_s[:, None]) * HEAD_D + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Power-of-two split count from host facts only (graph-safe).

    Aim for about ``CTAS_PER_SM`` programs per multiprocessor, never more than
    ``MAX_SPLITS`` splits, and at least ``MIN_TOKENS_PER_SPLIT`` tokens per split of
    a ``max_context``-token request (pass a static bound such as max_model_len
    when the launch is captured in a graph).
    """
    programs = max(1, num_reqs * num_kv_heads)
    target = CTAS_PER_SM * num_sms
    s = 1
    while (
        s * 2 <= MAX_SPLITS
        and programs * s * 2 <= target
        and s * 2 * MIN_TOKENS_PER_SPLIT <= max_context
    ):
        s *= 2
    return s


def decode_workspace_numel(num_tokens: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the split-K workspace: partial outputs, then log-sum-exps."""
    if num_splits <= 1:
        return 0
    return num_tokens * num_heads * num_splits * (head_dim + 1)


def _config(m_rows: int, head_dim: int) -> tuple[int, bool, int, int]:
    """(BLOCK_M, USE_DOT, BLOCK_N, num_warps) for ``m_rows`` query rows per KV head."""
    if m_rows <= 2:
        block_m = next_pow2(m_rows)
        return block_m, False, 32 if head_dim <= 128 else 16, 4
    block_m = max(16, next_pow2(m_rows))
    block_n = 64 if head_dim <= 128 and block_m <= 64 else 32
    return block_m, True, block_n, 4


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    q_len: int,
    num_reqs: int,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``num_reqs * q_len`` query rows ``q`` [>=B*q_len, H, D].

    ``kv_cache`` [2, blocks, block_size, Hkv, D]; ``seq_lens`` [>=B] int32;
    ``block_tables`` [>=B, max_blocks] int32. Rows of ``out`` past ``B*q_len`` are
    left untouched. ``workspace`` (fp32, at least :func:`decode_workspace_numel`
    elements) is used when ``num_splits > 1``; one is allocated if not given.
    """
    check_device(q, "decode_attention")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, page, hkv, d = kv_cache.shape
    if d != head_dim or num_heads % hkv:
        raise ValueError(f"q heads/dim ({num_heads}, {head_dim}) do not fit the cache ({hkv}, {d})")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("decode_attention needs unit stride along head_dim")
    group = num_heads // hkv
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    block_m, use_dot, block_n, warps = _config(q_len * group, head_dim)
    block_n = max(block_n, 16)
    split = num_splits > 1
    ntok = num_reqs * q_len
    ws_o = ws_lse = out  # placeholders when not splitting (never touched)
    if split:
        need = decode_workspace_numel(ntok, num_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        if workspace.numel() < need or workspace.dtype != torch.float32:
            raise ValueError(f"decode workspace needs {need} fp32 elements")
        n_o = ntok * num_heads * num_splits * head_dim
        ws_o, ws_lse = workspace[:n_o], workspace[n_o:need]
    kc, vc = kv_cache[0], kv_cache[1]
    half = FP8_HALF and kv_cache.dtype == FP8_DTYPE and q.dtype in (torch.bfloat16, torch.float16)
    _decode_kernel[(num_reqs, hkv, num_splits)](
        q,
        kc,
        vc,
        block_tables,
        seq_lens,
        out,
        ws_o,
        ws_lse,
        scale * LOG2E,
        num_splits,
        q_len,
        q.stride(0),
        q.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        NUM_HEADS=num_heads,
        HEAD_D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_DOT=use_dot,
        SPLIT=split,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(q.dtype),
        HALF=half,
        ASM=half and not interpret_mode(),
        num_warps=warps,
        num_stages=num_stages(kv_cache),
        **pdl_args(q.device),
    )
    if split:
        _reduce_kernel[(ntok, num_heads)](
            ws_o,
            ws_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_D=head_dim,
            BLOCK_D=next_pow2(head_dim),
            BLOCK_S=next_pow2(num_splits),
            num_warps=4,
            **pdl_args(ws_o.device),
        )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    q_len: int,
    num_reqs: int,
) -> torch.Tensor:
    """Plain-torch reference (fp32 math, one request at a time; host syncs allowed)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // hkv
    out = torch.zeros(num_reqs * q_len, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for b in range(num_reqs):
        n = int(seq_lens[b])
        if n == 0:
            continue
        nblk = -(-n // page)
        bt = block_tables[b, :nblk].long()
        k = kv_cache[0][bt].reshape(-1, hkv, head_dim)[:n].float()
        v = kv_cache[1][bt].reshape(-1, hkv, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[b * q_len : (b + 1) * q_len].float().transpose(0, 1)  # [H, q_len, D]
        s = (qb @ k.transpose(1, 2)) * scale
        q_pos = n - q_len + torch.arange(q_len, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v
        out[b * q_len : (b + 1) * q_len] = o.transpose(0, 1).to(q.dtype)
    return out
