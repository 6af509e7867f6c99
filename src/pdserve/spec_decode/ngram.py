"""N-gram (prompt lookup) drafting, vectorised over the batch on the device.

For each request the last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, longest first) are looked up in the request's earlier tokens;
at the most recent earlier occurrence, the k tokens that followed it are the drafts
(-1 where fewer than k followed before the end). A request with no match gets k
placeholders (-1), which the verify step computes and never accepts: batches stay
uniform (1 + k tokens per request), so they stay on their CUDA graphs.

Token history: a device buffer per runner row. A row's known tokens are uploaded from
the host's token table the first time a request is seen in it (or when the row changed
hands); after that each step's accepted tokens are scattered in on the device, so under
async scheduling the history is current although the host is a step behind.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.spec_decode.proposer import DraftBatch


class NgramProposer:
    def __init__(
        self,
        num_speculative_tokens: int,
        n_min: int,
        n_max: int,
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.n_min, self.n_max = n_min, n_max
        self.hist = torch.full(
            (max_num_reqs, max_model_len + 1), -1, dtype=torch.int64, device=device
        )
        self._owner: list[str | None] = [None] * max_num_reqs

    def _adopt(self, batch: DraftBatch) -> None:
        """Upload the host's known tokens of rows whose request is new to them."""
        for i, (row, rid) in enumerate(zip(batch.rows.tolist(), batch.req_ids, strict=True)):
            if self._owner[row] == rid:
                continue
            self._owner[row] = rid
            n = int(batch.num_known[i])
            known = torch.from_numpy(np.ascontiguousarray(batch.token_table[row, :n]))
            self.hist[row].fill_(-1)
            self.hist[row, :n] = known.to(self.hist.device, non_blocking=True)

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        self._adopt(batch)
        k = self.num_speculative_tokens
        dev = self.hist.device
        rows = torch.from_numpy(batch.rows).to(dev, non_blocking=True)
        width = batch.sampled.shape[1]
        # this step's accepted tokens sit at next_positions - num + 1 .. next_positions
        j = torch.arange(width, device=dev)
        pos = batch.next_positions[:, None] - batch.num_sampled[:, None] + 1 + j[None, :]
        ok = (j[None, :] < batch.num_sampled[:, None]) & torch.from_numpy(batch.samples).to(
            dev, non_blocking=True
        )[:, None]
        cap = self.hist.shape[1] - 1
        self.hist[rows[:, None].expand_as(pos), pos.clamp(0, cap)] = torch.where(
            ok, batch.sampled, self.hist[rows[:, None].expand_as(pos), pos.clamp(0, cap)]
        )
        length = batch.next_positions + 1  # known tokens
        span = min(batch.max_context, cap)
        h = self.hist[rows, :span]
        idx = torch.arange(span, device=dev)
        best = torch.full_like(length, -1)  # where the continuation starts, -1: no match
        for n in range(self.n_max, self.n_min - 1, -1):
            if n >= span:
                continue
            suffix = h.gather(
                1, (length[:, None] - n + torch.arange(n, device=dev)).clamp(0, span - 1)
            )
            windows = h.unfold(1, n, 1)  # [B, span - n + 1, n]
            match = (windows == suffix[:, None, :]).all(-1)
            starts = idx[: windows.shape[1]]
            match &= (starts[None, :] < (length - n)[:, None]) & (length[:, None] > n)
            last = torch.where(match, starts[None, :], -1).amax(dim=1)
            found = (last >= 0) & (best < 0)
            best = torch.where(found, last + n, best)
        cont = best[:, None] + torch.arange(k, device=dev)[None, :]
        valid = (best[:, None] >= 0) & (cont < length[:, None])
        drafts = h.gather(1, cont.clamp(0, span - 1))
        return torch.where(valid, drafts, -1)
