"""The runner's persistent per-request state on the host, kept in preallocated numpy rows.

A request gets a row when the runner first sees it and keeps it until it finishes
or is preempted. Rows hold its token ids (those it was admitted with, then those of
each step that landed), block table, the host's counts and sampling parameters, so
building a step's flat batch is array indexing over rows, not Python loops over
tokens. What the device knows ahead of the host is in
:mod:`pdserve.runner.request_state`, under the same row numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import CachedRequestData, NewRequestData


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        # tokens known here (admitted with or landed): inputs past them come from the
        # request state
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.banned_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        # logit_bias (ids, values) and allowed_token_ids of each row, None where unset
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * max_num_reqs
        self.allowed_ids: list[np.ndarray | None] = [None] * max_num_reqs
        # which rows use each (so a step where none does costs one numpy check)
        self.has_bias = np.zeros(max_num_reqs, dtype=bool)
        self.has_allowed = np.zeros(max_num_reqs, dtype=bool)
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        # prompt_logprobs N and logprobs N of each row, -1 where not asked
        self.prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        # min_tokens of the rows that have ids to ban until then (EOS / stop ids), else 0
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.generators: dict[int, torch.Generator] = {}
        self.row_of: dict[str, int] = {}
        # the runner step that gave each row to its request, -1: free (a step's results
        # land only in the rows it was prepared for)
        self.added_at = np.full(max_num_reqs, -1, dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def record(self, rows: np.ndarray, step: int, tokens: np.ndarray, num: np.ndarray) -> None:
        """Append the tokens step ``step`` accepted (``tokens[i, :num[i]]``) to ``rows``,
        except rows that changed hands since that step was prepared."""
        at = self.added_at[rows]
        ok = (at >= 0) & (at <= step) & (num > 0)
        rows, tokens, n = rows[ok], tokens[ok], num[ok]
        if not len(rows):
            return
        cap = self.token_ids.shape[1]
        start = self.num_tokens[rows]
        if (n == 1).all():  # one token each (no drafts, or all rejected)
            keep = start < cap
            self.token_ids[rows[keep], start[keep]] = tokens[keep, 0]
            self.num_tokens[rows] = np.minimum(start + 1, cap)
            return
        which = np.repeat(np.arange(len(rows)), n)
        off = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        pos = start[which] + off
        keep = pos < cap
        self.token_ids[rows[which][keep], pos[keep]] = tokens[which, off][keep]
        self.num_tokens[rows] = np.minimum(start + n, cap)

    def add(self, new: NewRequestData, device: torch.device, step: int) -> None:
        if new.req_id in self.row_of:
            self.remove(new.req_id)
        if not self._free_rows:
            raise RuntimeError("the runner has no free request row (max_num_seqs exceeded)")
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        self.added_at[row] = step
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        nb = len(new.block_ids)
        self.block_table[row, :nb] = new.block_ids
        self.num_blocks[row] = nb
        sp = new.sampling_params
        self.params[row] = sp
        self.temperature[row] = 1.0 if sp.greedy else sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.banned_ids[row] = sorted(
            set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(new.eos_token_ids))
        )
        self.greedy[row] = sp.greedy
        self.min_tokens[row] = sp.min_tokens if self.banned_ids[row] else 0
        self.logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        lb = sp.logit_bias
        self.bias[row] = (
            (
                np.fromiter(lb.keys(), dtype=np.int64, count=len(lb)),
                np.fromiter(lb.values(), dtype=np.float32, count=len(lb)),
            )
            if lb
            else None
        )
        al = sp.allowed_token_ids
        self.allowed_ids[row] = np.asarray(al, dtype=np.int64) if al is not None else None
        self.has_bias[row] = self.bias[row] is not None
        self.has_allowed[row] = al is not None
        self.has_penalties[row] = sp.has_penalties
        self.prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        if sp.seed is not None and not sp.greedy:
            gen = torch.Generator(device=device)
            gen.manual_seed(sp.seed)
            # a request resumed after preemption replays the draws it already consumed, so
            # its samples stay on the stream they would have been on (rare; not a hot path)
            for _ in range(n - new.num_prompt_tokens):
                torch.empty(self.vocab_size, device=device).exponential_(generator=gen)
            self.generators[row] = gen

    def update(self, cached: CachedRequestData) -> None:
        row = self.row_of[cached.req_id]
        self.num_computed[row] = cached.num_computed_tokens
        k = len(cached.new_block_ids)
        start = cached.num_blocks - k
        if k:
            self.block_table[row, start : cached.num_blocks] = cached.new_block_ids
        self.num_blocks[row] = cached.num_blocks

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.params[row] = None
        self.bias[row] = None
        self.allowed_ids[row] = None
        self.has_bias[row] = self.has_allowed[row] = self.has_penalties[row] = False
        self.prompt_logprobs[row] = self.logprobs[row] = -1
        self.greedy[row] = False
        self.min_tokens[row] = 0
        self.added_at[row] = -1
        self.generators.pop(row, None)
        self.num_blocks[row] = 0
        self._free_rows.append(row)
