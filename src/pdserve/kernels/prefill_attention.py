"""Flash-attention style causal attention over the paged KV cache, for any batch.

Request ``b`` owns flat query rows ``query_start_loc[b] : query_start_loc[b+1]``
(``q_len_b`` of them): the last ``q_len_b`` positions of its ``seq_lens[b]``-token
context, whose K/V (cached prefix and this step's tokens alike) are already in
the cache. Row ``i`` attends to keys ``0 .. seq_lens[b] - q_len_b + i``. Mixed
batches (decodes with ``q_len`` 1 next to prompt chunks) are fine: this kernel
serves every batch the uniform decode kernel does not.

Grid: ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)``. Request ``b`` owns the
q-block indices starting at ``query_start_loc[b] // BLOCK_Q + b`` (enough of them
for its ``cdiv(q_len_b, BLOCK_Q)`` blocks; surplus programs exit at once); a
program finds its request by binary search over ``query_start_loc``. The grid is
therefore a function of host ints only (no sync, graph-capturable). Each program
holds ``BLOCK_Q`` tokens x all ``group`` query heads of one KV head
(``BLOCK_M = BLOCK_Q * group`` rows, padded to a power of two), so K/V tiles
are read once per KV group, and streams the keys up to its last row's position
through an online softmax (fp32 accumulation, exp2 domain). A float8_e4m3fn cache is
read as :func:`decode_attention`'s is: its K scale folded into ``scale`` by the caller,
its V scale applied to the output.

The alternative for a single prompt with no cached prefix is
:func:`sdpa_prefill` (torch's fused SDPA on this step's contiguous K/V), faster for
that case (``benchmarks/RESULTS.md``, "Kernel measurements"), so the backend uses
it there. A
batch of several prompts would need one SDPA call per request from a host loop
(host time per request per layer, and per-request lengths on the host); this
kernel handles any batch in one launch, cached prefixes included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.kernels._utils import (
    LOG2E,
    check_device,
    dot_precision,
    dot_upcast,
    env_choice,
    next_pow2,
)


@triton.jit
def _tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    kv_end,
    q_pos,
    bt_row,
    k_ptr,
    v_ptr,
    kvh,
    offs_d,
    d_ok,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One K/V tile of the online softmax. Unmasked tiles lie wholly below every
    row's diagonal and inside the context (no key mask, no causal mask)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        n_ok = offs_n >= 0
        blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
    in_blk = offs_n % PAGE
    k_off = blk * stride_kb + in_blk * stride_ks + kvh * stride_kh
    v_off = blk * stride_vb + in_blk * stride_vs + kvh * stride_vh
    kt = tl.load(
        k_ptr + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0
    )
    kt = kt.to(q.dtype)  # fp8 (its scale is in qk_scale) or bf16 upcast
    s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale
    if MASKED:
        keep = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
    )
    v = v.to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_reqs"])  # one compile for every batch size
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    qk_scale,
    num_reqs,
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
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # largest b with query_start_loc[b] // BLOCK_Q + b <= pid
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid, mid, lo)
        hi = tl.where(first <= pid, hi, mid - 1)
    b = lo
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q_off = (pid - (q_start // BLOCK_Q + b)) * BLOCK_Q  # first local row of this block
    if q_off < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        tok = q_off + rows // G
        head = kvh * G + rows % G
        row_ok = (rows < BLOCK_Q * G) & (tok < q_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_D
        t_idx = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = prefix + tok
        kv_end = tl.minimum(seq_len, prefix + q_off + BLOCK_Q)
        # keys < full_end are visible to every row of the block: no masks there
        full_end = (prefix + q_off + 1) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, n0, kv_end, q_pos, bt_row, k_ptr, v_ptr, kvh, offs_d, d_ok,
                qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                PAGE, BLOCK_N, False, DOT_PREC, UPCAST,
            )  # fmt: skip
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _tile(
                q, m_i, l_i, acc, n0, kv_end, q_pos, bt_row, k_ptr, v_ptr, kvh, offs_d, d_ok,
                qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                PAGE, BLOCK_N, True, DOT_PREC, UPCAST,
            )  # fmt: skip
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        dst = out_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


PrefillConfig = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


def _config(max_query_len: int, group: int, head_dim: int) -> PrefillConfig:
    """128 rows x 64 keys, 4 warps, 3 stages for head dims up to 128 (the best of the
    configs tried, ``benchmarks/RESULTS.md``). Decode-heavy batches get smaller row
    tiles (a 1-token request fills only ``group`` rows of its tile)."""
    cap = 128 if head_dim <= 128 else 64
    block_m = min(cap, max(16, next_pow2(max_query_len * group)))
    block_m = max(block_m, next_pow2(group))  # at least one token per program
    if head_dim <= 128:
        return block_m, 64, 4, 3
    return block_m, 32, 4, 2


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal paged attention for the first ``num_tokens`` rows of ``q`` [T, H, D].

    ``query_start_loc`` [>=B+1] int32, ``seq_lens`` [>=B] int32, ``block_tables``
    [>=B, max_blocks] int32; ``num_reqs``, ``num_tokens`` (= query_start_loc[B])
    and ``max_query_len`` are host ints (the last only picks tile sizes). Rows of
    ``out`` past ``num_tokens`` are left untouched. ``config`` overrides the tile
    heuristic (benchmarks and tuning).
    """
    check_device(q, "prefill_attention")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, _, page, hkv, d = kv_cache.shape
    if d != head_dim or num_heads % hkv:
        raise ValueError(f"q heads/dim ({num_heads}, {head_dim}) do not fit the cache ({hkv}, {d})")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("prefill_attention needs unit stride along head_dim")
    group = num_heads // hkv
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0 or num_tokens == 0:
        return out
    block_m, block_n, warps, stages = config or _config(max_query_len, group, head_dim)
    block_q = block_m // group
    kc, vc = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_reqs, hkv)
    _prefill_kernel[grid](
        q,
        kc,
        vc,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        num_reqs,
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
        HEAD_D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


# torch SDPA's kernels in the order tried, by name. cuDNN's attention builds an
# execution plan for every new shape, which costs a request of a length not seen before
# tens of milliseconds (benchmarks/warm_diag.py measures it), so under "cudnn" a prompt
# is padded at its end to a bucket (:func:`sdpa_bucket`): causal rows never see the keys
# after them, so the padding changes no real row.
SDPA_ORDERS = {
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}  # fmt: skip
# the choices: an order, "_gqa" where SDPA shares the K/V heads (enable_gqa) instead of
# taking expanded copies of them
SDPA_KERNELS = ("flash", "flash_gqa", "cudnn", "cudnn_gqa")
# an 8K llama-8b-shape prompt (32 / 8 heads of 128): cudnn_gqa 554 TFLOP/s, cudnn 493,
# flash_gqa 324, flash 291; at 8,000 tokens (padded to 8,192, real rows' FLOPs) 491,
# with that bucket's plan reused: 1.6 ms for the first call (RESULTS.md run 133, H100)
SDPA_KERNEL = "cudnn_gqa"
SDPA_ENV = "PDSERVE_SDPA_PREFILL"  # one of SDPA_KERNELS: the engine's choice instead


def sdpa_bucket(n: int) -> int:
    """``n`` rounded up to a sixteenth of its power of two (at least 128): at most 16
    lengths, so 16 cuDNN plans, an octave, and at most 1/8 of the rows padding."""
    step = max(128, next_pow2(n) // 16)
    return -(-n // step) * step


def sdpa_kernel_name(kernel: str | None = None) -> str:
    """``kernel``, else ``PDSERVE_SDPA_PREFILL``'s, else :data:`SDPA_KERNEL`; a name not
    in :data:`SDPA_KERNELS` raises ``ValueError``."""
    return env_choice(kernel, SDPA_ENV, SDPA_KERNEL, SDPA_KERNELS, "SDPA prefill kernel")


def warm_sdpa_plans(
    shapes: set[tuple[int, int, int]], max_tokens: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Under a cuDNN kernel: one :func:`sdpa_prefill` call per (heads, KV heads, head dim)
    of ``shapes`` at every bucket length up to ``max_tokens``'s, so that cuDNN has built
    each plan a prompt can need before one arrives (the engine's warm-up). Returns the
    calls made: none under flash, whose kernels need no plan."""
    if not sdpa_kernel_name().startswith("cudnn"):
        return 0
    calls, top = 0, sdpa_bucket(max_tokens)
    for heads, kv_heads, dim in sorted(shapes):
        n = sdpa_bucket(1)
        while n <= top:
            q = torch.zeros(n, heads, dim, dtype=dtype, device=device)
            kv = torch.zeros(n, kv_heads, dim, dtype=dtype, device=device)
            sdpa_prefill(q, kv, kv, dim**-0.5)
            calls += 1
            n = sdpa_bucket(n + 1)
    return calls


def sdpa_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    kernel: str | None = None, strict: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of ONE request with no cached prefix, straight from this
    step's contiguous ``q`` [n, H, D], ``k``/``v`` [n, Hkv, D] (torch's fused SDPA):
    ``kernel`` one of :data:`SDPA_KERNELS`, else ``PDSERVE_SDPA_PREFILL``'s, else
    :data:`SDPA_KERNEL`; ``strict`` allows only its order's first kernel (an error where
    that one cannot run: benches)."""
    kernel = sdpa_kernel_name(kernel)
    backend, gqa = kernel.removesuffix("_gqa"), kernel.endswith("_gqa")
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    if backend == "cudnn" and (m := sdpa_bucket(n)) != n:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, m - n)) for t in (q, k, v))
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if group > 1 and not gqa:
        kh = kh.repeat_interleave(group, dim=1)
        vh = vh.repeat_interleave(group, dim=1)
    order = list(SDPA_ORDERS[backend][: 1 if strict else None])
    with sdpa_kernel(order, set_priority=True):
        o = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa and group > 1
        )
    return o.squeeze(0).transpose(0, 1)[:n]


def prefill_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_reqs: int,
) -> torch.Tensor:
    """Plain-torch reference (fp32 math, one request at a time; host syncs allowed)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // hkv
    qsl = query_start_loc.tolist()
    out = torch.zeros(qsl[num_reqs], num_heads, head_dim, dtype=q.dtype, device=q.device)
    for b in range(num_reqs):
        n = int(seq_lens[b])
        s0, s1 = qsl[b], qsl[b + 1]
        ql = s1 - s0
        if ql == 0:
            continue
        nblk = -(-n // page)
        bt = block_tables[b, :nblk].long()
        k = kv_cache[0][bt].reshape(-1, hkv, head_dim)[:n].float()
        v = kv_cache[1][bt].reshape(-1, hkv, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[s0:s1].float().transpose(0, 1)
        s = (qb @ k.transpose(1, 2)) * scale
        q_pos = n - ql + torch.arange(ql, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v
        out[s0:s1] = o.transpose(0, 1).to(q.dtype)
    return out
