"""The MoE router's selection in one kernel: sigmoid, correction bias, grouped top-k,
weights from the unbiased scores, normalisation and scaling (DeepSeek-V3 / GLM-5
``noaux_tc``, :func:`pdserve.layers.moe.grouped_topk` is the reference).

Input: the router logits ``x W^T`` [T, E] in float32 (one cuBLAS GEMM in float32 before
this). Program ``i`` takes ``BLOCK_T`` tokens and every expert column:

    s = sigmoid(logits); c = s + bias
    n_group > 1: each group's score is the sum of its two best c; the topk_group best
                 groups stay, the other experts' c become -inf
    top_k times: take the best c (lowest index on ties), record it, mask it
    weights = s[chosen] / (sum + 1e-20 if norm_topk_prob) * routed_scaling_factor

No host sync, static shapes: a decode batch captures in a CUDA graph.

The logits themselves (:func:`router_logits`, prefill-sized bf16 batches of at least
:data:`ROUTER_GEMM_MIN_TOKENS` tokens): the float32 GEMM without a float32 copy of the
activations. A bf16 activation is exact in float32, and each float32 weight is split in
the kernel into three bf16 parts (``hi = bf16(w)``, ``mid = bf16(w - hi)``,
``lo = bf16(w - hi - mid)``: 24 of float32's 24 significant bits); every product of a
bf16 activation and a part is exact in float32, so three bf16 tensor-core dots with a
float32 accumulator give the float32 product up to the order of its additions. Fewer
tokens keep cuBLAS's float32 GEMM, which spreads the weight's reads over the GPU (a
program here reads the whole weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, dot_upcast, next_pow2, pdl_args, pdl_enter

ROUTER_GEMM_MIN_TOKENS = 2048  # prefill-sized: verify and decode steps keep cuBLAS (spread reads)
_LOGITS_BLOCK_T = 64
_LOGITS_BLOCK_K = 64


@triton.jit
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    H,
    E,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    c_ok = cols < E
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < H
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + kk[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols[None, :] * stride_we + kk[:, None],
                    mask=c_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_E] fp32
        hi = w.to(dt)
        rest = w - hi.to(tl.float32)
        mid = rest.to(dt)
        lo = (rest - mid.to(tl.float32)).to(dt)
        if UPCAST:  # the interpreter's bf16 dot: float32 operands of the same values
            a = a.to(tl.float32)
            hi = hi.to(tl.float32)
            mid = mid.to(tl.float32)
            lo = lo.to(tl.float32)
        acc = tl.dot(a, hi, acc=acc)
        acc = tl.dot(a, mid, acc=acc)
        acc = tl.dot(a, lo, acc=acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc,
             mask=r_ok[:, None] & c_ok[None, :])  # fmt: skip


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` [T, E] in float32 from bf16 ``x`` [T, H] and float32 ``weight`` [E, H]
    (module docstring: the float32 GEMM's value, no float32 copy of ``x``)."""
    check_device(x, "router_logits")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32:
        raise ValueError(f"router_logits takes bf16 tokens and a float32 weight: "
                         f"{x.dtype}, {weight.dtype}")  # fmt: skip
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("router_logits needs unit stride along the hidden dimension")
    t, h = x.shape
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    _router_logits_kernel[(triton.cdiv(t, _LOGITS_BLOCK_T),)](
        x, weight, out, t, h, e, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=_LOGITS_BLOCK_T, BLOCK_E=max(16, next_pow2(e)), BLOCK_K=_LOGITS_BLOCK_K,
        UPCAST=dot_upcast(x.dtype), num_warps=4, num_stages=3,
        **pdl_args(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _router_kernel(
    logits_ptr,
    bias_ptr,
    w_out_ptr,
    id_out_ptr,
    T,
    E,
    scale,
    stride_lt,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    c_ok = cols < E
    lg = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :],
        mask=r_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    s = 1.0 / (1.0 + tl.exp(-lg))
    bias = tl.load(bias_ptr + cols, mask=c_ok, other=0.0)
    c = tl.where(c_ok[None, :], s + bias[None, :], float("-inf"))
    if N_GROUP > 1:
        per_group = E // N_GROUP
        group_of = cols // per_group
        gcols = tl.arange(0, BLOCK_G)
        gscore = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (group_of == g)[None, :] & c_ok[None, :]
            cg = tl.where(in_g, c, float("-inf"))
            best = tl.argmax(cg, axis=1)
            v1 = tl.max(cg, axis=1)
            v2 = tl.max(tl.where(cols[None, :] == best[:, None], float("-inf"), cg), axis=1)
            gscore = tl.where(gcols[None, :] == g, (v1 + v2)[:, None], gscore)
        keep = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gscore, axis=1)
            hit = gcols[None, :] == gi[:, None]
            keep = tl.where(hit, 1, keep)
            gscore = tl.where(hit, float("-inf"), gscore)
        for g in tl.static_range(N_GROUP):  # drop the experts of the groups not kept
            kg = tl.sum(tl.where(gcols[None, :] == g, keep, 0), axis=1)
            c = tl.where((group_of == g)[None, :] & (kg == 0)[:, None], float("-inf"), c)
    kcols = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        e = tl.argmax(c, axis=1)
        hit = cols[None, :] == e[:, None]
        we = tl.sum(tl.where(hit, s, 0.0), axis=1)
        w = tl.where(kcols[None, :] == i, we[:, None], w)
        ids = tl.where(kcols[None, :] == i, e[:, None], ids)
        c = tl.where(hit, float("-inf"), c)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * scale
    out_mask = r_ok[:, None] & (kcols[None, :] < TOP_K)
    off = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    tl.store(w_out_ptr + off, w, mask=out_mask)
    tl.store(id_out_ptr + off, ids.to(tl.int64), mask=out_mask)


def router_select(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from float32 ``logits`` [T, E]."""
    check_device(logits, "router_select")
    t, e = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("router_select needs float32 logits with unit stride")
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= e:
        raise ValueError(f"bad routing: E={e} top_k={top_k} n_group={n_group} {topk_group=}")
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    block_e = next_pow2(e)
    block_t = max(1, min(16, 4096 // block_e))
    _router_kernel[(triton.cdiv(t, block_t),)](
        logits,
        bias.float().contiguous(),
        w,
        ids,
        t,
        e,
        routed_scaling_factor,
        logits.stride(0),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        TOP_K=top_k,
        BLOCK_K=next_pow2(top_k),
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        BLOCK_G=next_pow2(n_group),
        NORM=norm_topk_prob,
        num_warps=4,
        **pdl_args(logits.device),
    )
    return w, ids
