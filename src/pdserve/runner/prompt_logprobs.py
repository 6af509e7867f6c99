"""Prompt logprobs (vLLM's ``prompt_logprobs``) on the device, one prefill chunk at a time.

The hidden state of prompt position ``j`` gives the logits that score prompt token
``j + 1``. A step that computes positions ``c .. c+s-1`` of a request that asked for
prompt logprobs therefore scores prompt positions ``c+1 .. min(c+s, P-1)`` (``P`` the
prompt length; position ``P-1``'s logits sample the first output token and are not a
prompt logprob). Every such row of every request in the step is gathered from the
step's hidden states and scored in one batch:

- the logits go through an fp32 log-softmax over the whole vocabulary;
- kept per row: the actual token's logprob, its rank (how many ids have a logprob
  ``>=`` its own, as vLLM counts: 1 is the most likely, ties rank pessimistically) and
  the top-N ids and logprobs (N = the step's largest ``prompt_logprobs``; each request
  keeps its own first N);
- rows go through in pieces of at most ``max_rows`` so the ``[rows, vocab]`` fp32
  intermediates stay within :data:`PIECE_BYTES`, whatever the chunk's length.

Nothing here syncs: the plan is built on the host from the batch's numpy rows (the
prompt tokens are all known there), the results are written into pinned host buffers
with non-blocking copies and read after the step's one sync
(:meth:`PromptLogprobsHost.read`). Requests are scored independently of the step's
forward path (eager or graph replay), of drafting and of sampling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core_types.sampling_params import MAX_LOGPROBS
from pdserve.core_types.scheduler_output import PromptLogprobsChunk

PIECE_BYTES = 256 * 2**20  # fp32 logits + log-softmax of one piece of rows, at most

# (actual logprob [M] f32, rank [M] i64, top ids [M, N] i64, top logprobs [M, N] f32)
Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class PromptLogprobsPlan:
    """Which of the step's tokens are scored, for whom (host lists) and against what
    (device tensors). Request ``i`` owns rows ``offsets[i] .. offsets[i] + counts[i]``."""

    req_ids: list[str]
    starts: list[int]  # the first prompt position scored
    counts: list[int]
    offsets: list[int]
    ns: list[int]  # each request's own N
    num_top: int
    token_index: torch.Tensor  # [M] int64: flat token index in the step
    targets: torch.Tensor  # [M] int64: the prompt token each row scores

    @property
    def num_rows(self) -> int:
        return int(self.token_index.shape[0])


def plan_prompt_logprobs(
    req_ids: list[str],
    rows: np.ndarray,
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    prompt_n: np.ndarray,
    token_ids: np.ndarray,
    device: torch.device,
) -> PromptLogprobsPlan | None:
    """The step's plan, or None when no request of the step scores a prompt position.

    ``rows``, ``num_scheduled`` are per request of the step; ``num_computed``,
    ``num_prompt``, ``prompt_n`` (-1: not asked) and ``token_ids`` are the batch's
    per-row arrays."""
    want = prompt_n[rows]
    if not (want >= 0).any():
        return None
    start_tok = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(num_scheduled[:-1], out=start_tok[1:])
    comp = num_computed[rows]
    last = np.minimum(comp + num_scheduled, num_prompt[rows] - 1)  # exclusive end position
    counts = np.where(want >= 0, np.maximum(last - comp, 0), 0)
    sel = np.flatnonzero(counts > 0)
    if not len(sel):
        return None
    n = counts[sel]
    total = int(n.sum())
    off = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    tok_index = np.repeat(start_tok[sel], n) + off
    pos = np.repeat(comp[sel], n) + off  # the position whose logits score pos + 1
    targets = token_ids[np.repeat(rows[sel], n), pos + 1].astype(np.int64)
    offsets = np.zeros(len(sel), dtype=np.int64)
    np.cumsum(n[:-1], out=offsets[1:])
    packed = torch.from_numpy(np.concatenate([tok_index, targets]))
    if device.type == "cuda":
        packed = packed.pin_memory()
    dev = packed.to(device, non_blocking=True)
    return PromptLogprobsPlan(
        req_ids=[req_ids[i] for i in sel],
        starts=(comp[sel] + 1).tolist(),
        counts=n.tolist(),
        offsets=offsets.tolist(),
        ns=want[sel].tolist(),
        num_top=int(want[sel].max()),
        token_index=dev[:total],
        targets=dev[total:],
    )


def piece_rows(vocab_size: int, budget: int = PIECE_BYTES) -> int:
    """Rows per piece: the logits and their log-softmax in fp32 within ``budget``."""
    return max(1, budget // (8 * vocab_size))


def score_prompt_rows(
    hidden: torch.Tensor,
    plan: PromptLogprobsPlan,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    max_rows: int,
) -> Scored:
    """The :data:`Scored` tensors of the plan's rows, computed ``max_rows`` at a time."""
    m, k = plan.num_rows, plan.num_top
    dev = hidden.device
    lps = torch.empty(m, dtype=torch.float32, device=dev)
    ranks = torch.empty(m, dtype=torch.int64, device=dev)
    top_ids = torch.empty((m, k), dtype=torch.int64, device=dev)
    top_lps = torch.empty((m, k), dtype=torch.float32, device=dev)
    for a in range(0, m, max_rows):
        b = min(m, a + max_rows)
        logp = logits_fn(hidden.index_select(0, plan.token_index[a:b])).float().log_softmax(-1)
        actual = logp.gather(1, plan.targets[a:b, None])
        lps[a:b] = actual.squeeze(1)
        ranks[a:b] = (logp >= actual).sum(-1)
        if k:
            values, ids = logp.topk(k, dim=-1)
            top_ids[a:b] = ids
            top_lps[a:b] = values
    return lps, ranks, top_ids, top_lps


class PromptLogprobsHost:
    """Pinned host buffers for one step's prompt logprobs (allocated at the first step
    that has any, sized for a whole step of ``max_tokens`` rows)."""

    def __init__(self, max_tokens: int, pin: bool) -> None:
        self.lps = torch.zeros(max_tokens, dtype=torch.float32, pin_memory=pin)
        self.ranks = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin)
        self.top_ids = torch.zeros((max_tokens, MAX_LOGPROBS), dtype=torch.int64, pin_memory=pin)
        self.top_lps = torch.zeros((max_tokens, MAX_LOGPROBS), dtype=torch.float32, pin_memory=pin)

    def copy_from(self, scored: Scored) -> None:
        """Start the device-to-host copies (non-blocking)."""
        lps, ranks, ids, tops = scored
        m, k = ids.shape
        self.lps[:m].copy_(lps, non_blocking=True)
        self.ranks[:m].copy_(ranks, non_blocking=True)
        if k:
            leading_view(self.top_ids, (m, k)).copy_(ids, non_blocking=True)
            leading_view(self.top_lps, (m, k)).copy_(tops, non_blocking=True)

    def read(self, plan: PromptLogprobsPlan) -> dict[str, PromptLogprobsChunk]:
        """Each request's chunk (its own N of the step's top-N), once the step landed."""
        m, k = plan.num_rows, plan.num_top
        lps, ranks = self.lps[:m].numpy(), self.ranks[:m].numpy()
        ids = leading_view(self.top_ids, (m, k)).numpy()
        tops = leading_view(self.top_lps, (m, k)).numpy()
        out = {}
        for rid, start, off, cnt, n in zip(
            plan.req_ids, plan.starts, plan.offsets, plan.counts, plan.ns, strict=True
        ):
            sl = slice(off, off + cnt)
            out[rid] = PromptLogprobsChunk(
                start, lps[sl].copy(), ranks[sl].copy(), ids[sl, :n].copy(), tops[sl, :n].copy()
            )
        return out


def leading_view(buf: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The first elements of the host buffer ``buf`` as a contiguous view of ``shape``: the
    destination of a step's device-to-host copy. (A leading slice of a wider buffer,
    ``buf[:m, :k]``, is strided, and a copy into strided memory is not asynchronous: it
    waits for the device, the step in flight included; every MTP step with fewer than k
    drafts did, issue 27.)"""
    return buf.view(-1)[: math.prod(shape)].view(shape)
