"""Rejection sampling of a speculative verify step, on the device, with no host sync.

Request ``b`` verified ``d_b`` drafts: its logits rows ``row_start[b] ..
row_start[b] + d_b`` are the target's distributions at the last known token and at
each draft (row ``j`` judges draft ``j``; row ``d_b`` gives the bonus token).

- **greedy** rows (temperature 0): draft ``j`` is accepted while it equals the
  target's argmax at row ``j``; the first mismatch emits the argmax instead, and if
  every draft is accepted the argmax of row ``d_b`` is the bonus token.
- **probabilistic** rows: drafts are point guesses (probability 1 under the drafter),
  so draft ``x`` at row ``j`` is accepted with probability ``p_j(x)`` (the target's
  distribution after temperature, top-k, top-p, min-p); the first rejection emits a
  sample of ``p_j`` with ``x`` removed and renormalised, which makes every emitted
  token distributed exactly as ``p_j`` (Leviathan et al., 2023, with a one-hot
  draft distribution). Seeded requests draw their uniforms and noise from their own
  generators.
- a draft id below 0 (a placeholder, or no draft) is never accepted.

``method`` (``--speculative-config``'s ``rejection_sample_method``): ``probabilistic`` is
the above; ``strict`` accepts a draft only when it equals the target's own sample at its
row (exact too, lower acceptance at high temperature; greedy rows are the same either
way); ``synthetic`` accepts each draft with probability ``synthetic_rate`` whatever the
target says and emits a target sample at the first rejection: for timing random weights
at a chosen acceptance only (its output is not the model's distribution).

Output: ``tokens [B, k+1]`` (-1 past each request's count) and ``num [B]`` in
``1 .. d_b + 1``.
"""

from __future__ import annotations

import torch

from pdserve.layers.sampler import Sampler, SamplingMetadata


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,  # [R, V] float32 (raw; the sampler applies bans and filters)
    md: SamplingMetadata,  # per row
    drafts: torch.Tensor,  # [B, k] int64, -1 where none
    row_start: torch.Tensor,  # [B] int64
    num_rows: torch.Tensor,  # [B] int64 (d_b + 1)
    method: str = "probabilistic",
    synthetic_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    nreq, k = drafts.shape
    r = logits.shape[0]
    dev = logits.device
    ar = torch.arange(k + 1, device=dev)
    valid = ar[None, :] < num_rows[:, None]  # [B, k+1]
    idx = torch.where(valid, row_start[:, None] + ar[None, :], r)  # r: a scratch row
    # the draft each row judges (-1 for bonus rows and padding)
    padded_drafts = torch.cat([drafts, drafts.new_full((nreq, 1), -1)], dim=1)
    judged = torch.full((r + 1,), -1, dtype=torch.int64, device=dev)
    judged.scatter_(0, idx.flatten(), torch.where(valid, padded_drafts, -1).flatten())
    judged = judged[:r]
    has_draft = judged >= 0
    logits = sampler.masked(logits, md)
    if method == "synthetic":
        candidate = _samples(sampler, logits, md)
        accept = has_draft & (sampler.uniform(r, dev, md) < synthetic_rate)
    elif md.all_greedy:
        target = logits.argmax(dim=-1)
        accept = has_draft & (judged == target)
        candidate = target
    elif method == "strict":
        candidate = _samples(sampler, logits, md)
        accept = has_draft & (judged == candidate)
    else:
        p = sampler.probs(logits, md)
        col = judged.clamp(min=0).unsqueeze(1)
        accept = has_draft & (sampler.uniform(r, dev, md) < p.gather(1, col).squeeze(1))
        q = sampler.noise(p, md)
        # a rejected draft cannot be its own replacement: infinite noise loses the race
        q.scatter_(1, col, q.gather(1, col).masked_fill(has_draft.unsqueeze(1), float("inf")))
        candidate = (p / q).argmax(dim=-1)
    accept_ext = torch.cat([accept, accept.new_zeros(1)])
    acc = accept_ext[idx[:, :k]] & valid[:, 1:]  # draft j needs a row after it (the bonus row)
    num_acc = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    cand_ext = torch.cat([candidate, candidate.new_full((1,), -1)])
    last = cand_ext[idx.gather(1, num_acc.unsqueeze(1))]  # [B, 1]
    tokens = torch.where(ar[None, :k] < num_acc[:, None], drafts, -1)
    tokens = torch.cat([tokens, tokens.new_full((nreq, 1), -1)], dim=1)
    tokens.scatter_(1, num_acc.unsqueeze(1), last)
    return tokens, num_acc + 1


def _samples(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One sample of each row's distribution (its argmax for greedy rows)."""
    if md.all_greedy:
        return logits.argmax(dim=-1)
    p = sampler.probs(logits, md)
    return (p / sampler.noise(p, md)).argmax(dim=-1)


def token_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, row_start: torch.Tensor
) -> torch.Tensor:
    """Log-probability of ``tokens[b, j]`` under row ``row_start[b] + j`` of the raw
    logits ([B, k+1]; entries past a request's count are garbage)."""
    r = raw_logits.shape[0]
    ar = torch.arange(tokens.shape[1], device=tokens.device)
    rows = (row_start[:, None] + ar[None, :]).clamp(max=r - 1)
    lsm = raw_logits.log_softmax(dim=-1)
    return lsm[rows, tokens.clamp(min=0)]
