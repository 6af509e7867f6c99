"""Request state on the device: what a step leaves, per ``InputBatch`` row, for the next.

A step's results reach the step after it only through these tensors, in stream order:
:meth:`RequestState.post_update` writes them after sampling and drafting, and the next
step's :meth:`place` reads them while its inputs are prepared. So the host never
waits for a step to prepare the next one, and never patches inputs from one in flight.

Per row:

- ``last_token``: the last token the row's latest sampling step accepted. A step's
  input at a position past the tokens the host knows (``InputBatch.num_tokens``: the
  row's prompt and the tokens of the steps that landed) that is not a draft is that
  token. A synchronous step has none: its previous step landed before it was prepared.
  (Without a drafter a prompt chunk's step writes its row's too, a value never read:
  the row's inputs stay known to the host until it samples.)
- ``drafts``: the drafts proposed after that step (-1: none). A draft the scheduler
  sends as -1 is read from here.
- ``sampled`` / ``num_sampled``: that step's accepted tokens and their count (what the
  penalties count of the outputs the host has not seen land yet).
- ``num_computed``: tokens whose KV is computed, moved by each step's scheduled tokens
  less the drafts it rejected. Under async scheduling the host's count runs ahead by
  the drafts a step in flight will reject; positions, sequence lengths and slots are
  placed from this one. Without a drafter nothing is ever rejected, the host's counts
  are exact and placed on the host, and this count is not kept.

A row handed to a new request is reset by :meth:`reset` in stream order, after the
previous owner's last ``post_update``: nothing of the previous owner survives it.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.layers.fused import use_fused_kernels
from pdserve.runner.input_buffers import InputBuffers


class RequestState:
    def __init__(
        self, max_num_reqs: int, num_spec: int, device: torch.device, drafting: bool
    ) -> None:
        r, k, i64 = max_num_reqs, max(num_spec, 1), torch.int64
        self.drafting = drafting  # drafts can be rejected: num_computed is kept here
        self.fused = use_fused_kernels(device)  # post_update in one kernel launch
        # one extra row (index r): where rows that sampled nothing write, unread
        self.scratch = r
        self.last_token = torch.zeros(r + 1, dtype=i64, device=device)
        self.drafts = torch.full((r + 1, k), -1, dtype=i64, device=device)
        self.sampled = torch.full((r + 1, num_spec + 1), -1, dtype=i64, device=device)
        self.num_sampled = torch.zeros(r + 1, dtype=i64, device=device)
        self.num_computed = torch.zeros(r + 1, dtype=i64, device=device)
        self._ones = torch.ones(r, dtype=i64, device=device)
        self._none = torch.full((r, k), -1, dtype=i64, device=device)

    def warm_up(self, buf: InputBuffers) -> None:
        """Compile every variant of the fused kernels a step can launch (start-up), with
        one-row calls that write only the scratch row; traffic then compiles none."""
        if not self.fused:
            return
        from pdserve.kernels.request_state import post_update_variants

        dev, i64 = self.last_token.device, torch.int64
        row = torch.full((1,), self.scratch, dtype=i64, device=dev)
        zero = torch.zeros_like(row)
        if self.drafting:  # post_update's variants, and place with drafts
            one = torch.ones_like(row)
            tokens = torch.zeros((1, self.sampled.shape[1]), dtype=i64, device=dev)
            drafts = torch.full((1, self.drafts.shape[1]), -1, dtype=i64, device=dev)
            nothing = torch.zeros(1, dtype=torch.bool, device=dev)  # sampled nothing: scratch
            for has_num, has_rows, has_drafts in post_update_variants():
                self.post_update(
                    row, zero, one if has_rows else None, nothing, tokens,
                    one if has_num else None, drafts if has_drafts else None,
                )  # fmt: skip
            none = torch.empty(0, dtype=i64, device=dev)
            slot = buf.drafts.dev[:1]
            slot.fill_(-2)
            self.place(buf, row, zero, 0, zero, zero, slot, none, none)
        # the scratch row's last token placed as input 0 (the buffers are written anew by
        # every step's prepare)
        self.place(buf, row, zero, 0, zero, zero, None, None, None)

    def reset(self, rows: torch.Tensor, num_computed: torch.Tensor) -> None:
        """Rows taken by new requests (admitted with ``num_computed`` tokens computed;
        their inputs are all known to the host until they sample)."""
        if self.drafting:
            self.num_sampled.index_fill_(0, rows, 0)
            self.drafts.index_fill_(0, rows, -1)
            self.num_computed.index_copy_(0, rows, num_computed)

    def place(
        self,
        buf: InputBuffers,
        rows: torch.Tensor,  # [B] the step's rows
        nsched: torch.Tensor,  # [B] scheduled tokens
        num_tokens: int,
        last_at: torch.Tensor,  # [L] token indices whose input is the row's last token
        last_req: torch.Tensor,  # [L] their request
        drafts: torch.Tensor | None,  # [B, k] the scheduler's drafts: -1 from here, -2 none
        draft_at: torch.Tensor | None,  # [D] token indices of draft slots
        draft_flat: torch.Tensor | None,  # [D] their flat index into ``drafts``
    ) -> None:
        """Fill the step's inputs that only the device knows: the last sampled tokens,
        the drafts, and (with a drafter) positions, sequence lengths and slots (on CUDA
        in two launches, :func:`pdserve.kernels.request_state.place`; these torch ops are
        its reference)."""
        if self.fused:
            from pdserve.kernels.request_state import place

            return place(
                buf.input_ids.dev, buf.positions.dev, buf.seq_lens.dev, buf.slots.dev,
                buf.req_idx.dev, buf.q_idx.dev, buf.block_tables.dev, buf.block_size,
                self.last_token, self.drafts, self.num_computed, self.drafting,
                rows, nsched, num_tokens, last_at, last_req, drafts, draft_at, draft_flat,
            )  # fmt: skip
        t, n = num_tokens, rows.shape[0]
        ids = buf.input_ids.dev
        if last_at.shape[0]:
            ids.index_copy_(0, last_at, self.last_token[rows.index_select(0, last_req)])
        if drafts is not None:
            assert draft_at is not None and draft_flat is not None
            merged = torch.where(drafts == -1, self.drafts[rows, : drafts.shape[1]], drafts)
            drafts.copy_(merged.clamp_(min=-1))
            ids.index_copy_(0, draft_at, drafts.view(-1)[draft_flat].clamp(min=0))
        if not self.drafting:
            return
        computed = self.num_computed.index_select(0, rows)
        req_idx = buf.req_idx.dev[:t]
        pos = buf.positions.dev[:t]
        torch.add(computed.index_select(0, req_idx), buf.q_idx.dev[:t], out=pos)
        buf.seq_lens.dev[:n].copy_(computed + nsched)
        bs = buf.block_size
        blocks = buf.block_tables.dev[req_idx, pos // bs].to(torch.int64)
        torch.add(blocks * bs, pos % bs, out=buf.slots.dev[:t])

    def post_update(
        self,
        rows: torch.Tensor,  # [B]
        nsched: torch.Tensor,  # [B]
        num_rows: torch.Tensor | None,  # [B] tokens verified (drafts + 1); None: all 1
        samples: torch.Tensor | None,  # [B] bool: the request sampled (with a drafter)
        tokens: torch.Tensor,  # [B, w] accepted tokens (-1 past the count)
        num: torch.Tensor | None,  # [B] accepted counts; None: all 1
        drafts: torch.Tensor | None,  # [B, k] proposed for the next step
    ) -> None:
        """After sampling and drafting: record the step in its rows (no sync; on CUDA one
        launch, :func:`pdserve.kernels.request_state.post_update`; these torch ops are its
        reference). Without a drafter, one op: every row's last token, sampled or not. A
        row that sampled nothing (a prompt chunk) has host-known inputs up to its first
        sampling step, which overwrites it, so nothing reads that value."""
        if not self.drafting:
            self.last_token.index_copy_(0, rows, _last(tokens, num))
            return None
        assert samples is not None
        if self.fused:
            from pdserve.kernels.request_state import post_update

            return post_update(
                self.last_token, self.sampled, self.num_sampled, self.drafts,
                self.num_computed, self.scratch,
                rows, nsched, num_rows, samples, tokens, num, drafts,
            )  # fmt: skip
        n, w = tokens.shape
        dst = torch.where(samples, rows, self.scratch)
        self.last_token.index_copy_(0, dst, _last(tokens, num))
        count = num if num is not None else self._ones[:n]
        self.num_sampled.index_copy_(0, dst, count)
        self.sampled[:, :w].index_copy_(0, dst, tokens)
        k = self.drafts.shape[1]
        self.drafts.index_copy_(0, dst, drafts[:, :k] if drafts is not None else self._none[:n])
        moved = nsched
        if num_rows is not None and num is not None:
            moved = nsched - torch.where(samples, num_rows - num, 0)
        self.num_computed.index_add_(0, rows, moved)

    def unlanded_outputs(
        self, rows: torch.Tensor, host_count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens [P, w], weights [P, w]): the accepted tokens of each row's latest
        sampling step but its last one (the next input, counted there) that the host
        does not hold yet (at positions from ``host_count``); None without a drafter
        (a step accepts one token: its last)."""
        if not self.drafting:
            return None
        toks = self.sampled.index_select(0, rows)
        num = self.num_sampled.index_select(0, rows)
        first = self.num_computed.index_select(0, rows) - num + 1  # position of toks[:, 0]
        j = torch.arange(toks.shape[1], device=toks.device)
        keep = (j[None, :] < (num - 1)[:, None]) & (
            first[:, None] + j[None, :] >= host_count[:, None]
        )
        return toks.clamp(min=0), keep.to(torch.float32)


def _last(tokens: torch.Tensor, num: torch.Tensor | None) -> torch.Tensor:
    """Each request's last accepted token (``num``: accepted counts; None: all 1)."""
    return tokens[:, 0] if num is None else tokens.gather(1, (num - 1).unsqueeze(1)).squeeze(1)


def draft_slots(
    q_idx: np.ndarray, req_idx: np.ndarray, nsched: np.ndarray, ndraft: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(is draft [T] bool, token indices of draft slots, their flat index into a [B, k]
    draft matrix): a request's drafts are its last ``ndraft`` scheduled tokens."""
    j = q_idx - (nsched - ndraft)[req_idx]
    is_draft = j >= 0
    at = np.flatnonzero(is_draft)
    return is_draft, at, req_idx[at] * k + j[at]
