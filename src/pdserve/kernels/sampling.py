"""Sort-free, sync-free sampling: greedy, temperature, top-k, top-p, min-p in one kernel.

Semantics are those of :class:`pdserve.layers.sampler.Sampler` (the sort-based
reference): ``x = logits / T``; keep the ``k`` largest ``x`` (ties with the k-th
kept); of those keep the nucleus (a token is kept when the probability mass
strictly above it, renormalised over the top-k set, is ``<= top_p``); of those
keep ``p >= min_p * p_max``; then draw with the exponential race
``argmax(p_i / E_i)`` where ``E`` [B, V] ~ Exp(1) is passed in (so seeded rows
keep using their own generators). Given the same ``E``, the kernel returns the
same token as the reference up to float rounding at boundaries: it ranks by
``log2(p_i / E_i)`` computed from the raw logits (no divisions), thresholds
top-k on the raw logits (ties of ``l/T`` that are not ties of ``l`` differ), and
at a tied top-p boundary keeps all tied tokens or none where the sort keeps
whichever its order puts first.

How it avoids the sort (one program per row, streaming the row through L2):

1. one pass: ``max x`` and the greedy argmax;
2. top-k (rows with ``k < V`` only): the k-th largest ``x`` exactly, by a 4-pass
   radix select over an order-preserving int32 key (256-bin ``tl.histogram``
   per byte);
3. one pass: ``Z_k`` (the top-k mass) and the first race winner ``c`` among
   tokens passing top-k and min-p;
4. top-p (rows with ``top_p < 1`` only): one pass computes the mass strictly
   above ``c`` *and* the race winner among tokens strictly above ``c``. If
   ``c`` is in the nucleus it is the answer; otherwise every token at or below
   ``c`` is outside the nucleus too, so the next winner (the next arrival of the
   same race, which is exactly how the reference would continue) is tested.
   Each round is one pass; the number of rounds is data dependent but runs on
   the device (expected few: a draw lands in the nucleus with probability
   about ``top_p``), capped at ``MAX_ROUNDS`` (then the last winner is taken).

So a top-p row costs about 3-4 passes over its logits (plus 5 for top-k), all
reading L2-resident data, against a full segmented sort plus softmax, cumsum and
scatter over [B, V] for the reference (timings against it in
``benchmarks/RESULTS.md``, "Kernel measurements"). One program per row, so small batches use few SMs. No host sync
anywhere; launch shape is (B,), so it is CUDA-graph capturable when ``E`` lives
in a static buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._utils import check_device, pdl_args, pdl_enter
from pdserve.kernels.reference import apply_top_k_top_p

MAX_ROUNDS = 64


@triton.jit
def _flip(k):
    """Order-preserving map between fp32 bits and int32 keys (its own inverse)."""
    return k ^ ((k >> 31) & 0x7FFFFFFF)


@triton.jit
def _argmax_update(best_v, best_i, vals, idx):
    """Fold one chunk's maximum into a running (value, first index) pair."""
    cv = tl.max(vals, axis=0)
    ci = tl.min(tl.where(vals == cv, idx, 2147483647), axis=0)
    better = cv > best_v
    return tl.where(better, cv, best_v), tl.where(better, ci, best_i)


@triton.jit
def _sample_kernel(
    logits_ptr,
    noise_ptr,
    out_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    greedy_ptr,
    stride_l,
    stride_n,
    V,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    lp = logits_ptr + row * stride_l
    npp = noise_ptr + row * stride_n
    ar = tl.arange(0, BLOCK)
    t = tl.load(temp_ptr + row)
    sampling = t > 0.0
    if HAS_GREEDY:
        sampling = sampling & (tl.load(greedy_ptr + row) == 0)
    t = tl.where(t > 0.0, t, 1.0)

    # 1. greedy argmax (and max) of the raw logits
    gmax = tl.full([], float("-inf"), tl.float32)
    garg = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + ar
        lg = tl.load(lp + offs, mask=offs < V, other=float("-inf"))
        gmax, garg = _argmax_update(gmax, garg, lg, offs)
    result = garg
    if sampling:
        # everything below works on the raw logits l (x = l / t is monotone in l):
        # e = exp(x - max x) = exp2((l - lmax) * a); race score log2(e / E)
        a = 1.4426950408889634 / t  # log2(e) / T
        # 2. exact k-th largest logit by radix select (skipped when k >= V)
        kth = tl.full([], float("-inf"), tl.float32)
        if HAS_TOP_K:
            k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row).to(tl.int32), 1), V)
            if k < V:
                bins = tl.arange(0, 256)
                prefix = tl.full([], 0, tl.int32)
                remaining = k
                for r in tl.static_range(4):
                    shift = 24 - 8 * r
                    hist = tl.zeros([256], tl.int32)
                    for v0 in range(0, V, BLOCK):
                        offs = v0 + ar
                        ok = offs < V
                        lg = tl.load(lp + offs, mask=ok, other=float("-inf"))
                        key = _flip(lg.to(tl.int32, bitcast=True))
                        digit = (key >> shift) & 255
                        if r == 0:
                            digit = digit ^ 128
                            match = ok
                        else:
                            match = ok & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                        hist += tl.histogram(digit, 256, mask=match)
                    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # count >= bin
                    sel = tl.max(tl.where(ge >= remaining, bins, -1), axis=0)
                    remaining -= tl.sum(tl.where(bins > sel, hist, 0), axis=0)
                    if r == 0:
                        sel = sel ^ 128
                    prefix = prefix | (sel << shift)
                kth = _flip(prefix).to(tl.float32, bitcast=True)
        # p >= min_p * p_max  <=>  (l - lmax) * a >= log2(min_p)
        lmin = tl.full([], float("-inf"), tl.float32)
        if HAS_MIN_P:
            lmin = gmax + tl.log2(tl.load(min_p_ptr + row)) / a
        # 3. top-k mass and the first race winner
        z = tl.zeros([BLOCK], tl.float32)
        cs = tl.full([], float("-inf"), tl.float32)
        ci = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + ar
            ok = offs < V
            lg = tl.load(lp + offs, mask=ok, other=float("-inf"))
            u = (lg - gmax) * a
            in_k = ok & (lg >= kth)
            z += tl.where(in_k, tl.exp2(u), 0.0)
            q = tl.load(npp + offs, mask=ok, other=1.0)
            score = tl.where(in_k & (lg >= lmin), u - tl.log2(q), float("-inf"))
            cs, ci = _argmax_update(cs, ci, score, offs)
        result = ci
        # 4. top-p: walk the race in arrival order until a winner is in the nucleus
        if HAS_TOP_P:
            budget = tl.load(top_p_ptr + row) * tl.sum(z, axis=0)
            go = tl.load(top_p_ptr + row) < 1.0
            rounds = tl.full([], 0, tl.int32)
            while go:
                cl = tl.load(lp + ci)
                above = tl.zeros([BLOCK], tl.float32)
                ns = tl.full([], float("-inf"), tl.float32)
                ni = tl.full([], 0, tl.int32)
                for v0 in range(0, V, BLOCK):
                    offs = v0 + ar
                    ok = offs < V
                    lg = tl.load(lp + offs, mask=ok, other=float("-inf"))
                    u = (lg - gmax) * a
                    higher = ok & (lg > cl) & (lg >= kth)
                    above += tl.where(higher, tl.exp2(u), 0.0)
                    q = tl.load(npp + offs, mask=ok, other=1.0)
                    score = tl.where(higher & (lg >= lmin), u - tl.log2(q), float("-inf"))
                    ns, ni = _argmax_update(ns, ni, score, offs)
                rounds += 1
                done = tl.sum(above, axis=0) <= budget
                done = done | (ns == float("-inf")) | (rounds >= MAX_ROUNDS)
                ci = tl.where(done, ci, ni)
                go = ~done
            result = ci
    tl.store(out_ptr + row, result.to(tl.int64))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    greedy_rows: torch.Tensor | None = None,
    block: int = 4096,
) -> torch.Tensor:
    """Token ids [B] (int64) from ``logits`` [B, V] float32.

    ``temperature`` [B] float32 (None: all greedy; rows with T <= 0 are greedy
    too); ``top_k`` [B] int (>= V disables), ``top_p`` [B] float32 (1.0 disables),
    ``min_p`` [B] float32 (0 disables), ``greedy_rows`` [B] bool; ``noise`` [B, V]
    float32 Exp(1) draws (drawn here from the default generator if None).
    """
    if temperature is None:
        return logits.argmax(dim=-1)
    check_device(logits, "sample")
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("sample needs float32 logits with unit inner stride")
    b, v = logits.shape
    if noise is None:
        noise = torch.empty_like(logits).exponential_()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    _sample_kernel[(b,)](
        logits,
        noise,
        out,
        temperature,
        top_k if top_k is not None else temperature,
        top_p if top_p is not None else temperature,
        min_p if min_p is not None else temperature,
        greedy_rows if greedy_rows is not None else temperature,
        logits.stride(0),
        noise.stride(0),
        v,
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        HAS_GREEDY=greedy_rows is not None,
        MAX_ROUNDS=MAX_ROUNDS,
        BLOCK=min(block, triton.next_power_of_2(v)),
        num_warps=16 if block >= 4096 else 8,
        **pdl_args(logits.device),
    )
    return out


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    greedy_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The runner's sort-based sampler math (:class:`pdserve.layers.sampler.Sampler`)."""
    greedy = logits.argmax(dim=-1)
    if temperature is None:
        return greedy
    if noise is None:
        noise = torch.empty_like(logits).exponential_()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = apply_top_k_top_p(logits / t.unsqueeze(1), top_k, top_p)
    probs = x.softmax(dim=-1)
    if min_p is not None:
        thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < thresh, 0.0)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = temperature <= 0
    if greedy_rows is not None:
        is_greedy = is_greedy | greedy_rows
    return torch.where(is_greedy, greedy, sampled)
