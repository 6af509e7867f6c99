"""Per logits row sampling inputs: the request's parameters, its min_tokens bans, logit
bias, allowed ids and penalties (built when the step is prepared), and the step's
structured-output bitmask and bad-word bans (added in the pipeline's masks phase,
after the step before has landed when the scheduler filled them late)."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.core_types.scheduler_output import SchedulerOutput
from pdserve.layers.sampler import SamplingMetadata
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers, upload
from pdserve.runner.penalty_counts import penalties
from pdserve.runner.request_state import RequestState


class SamplingInputs:
    def __init__(
        self,
        batch: InputBatch,
        buffers: InputBuffers,
        state: RequestState,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        self.batch = batch
        self.buf = buffers
        self.state = state
        self.device = device
        self.vocab_size = vocab_size

    def sampling_metadata(
        self,
        rows: np.ndarray,
        nsched: np.ndarray,
        ndraft: np.ndarray,
        lreq: np.ndarray,
        row_start: np.ndarray,
        samples: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Per logits row (``lreq[r]`` is its request): request ``i``'s rows sample its
        next ``num_drafts[i] + 1`` positions. A seeded request's generator is used only
        on the steps where it samples (``samples[i]``), so its draws do not depend on how
        its prompt was chunked or how much of it the prefix cache held."""
        b = self.batch
        rrows = rows[lreq]
        offset = np.arange(len(lreq)) - row_start[lreq]
        greedy = b.greedy[rrows]
        dev = self.device

        all_greedy = bool(greedy.all())
        temperature = top_k = top_p = min_p = greedy_rows = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = upload(b.temperature[rrows], dev)
            greedy_rows = upload(greedy, dev) if greedy.any() else None
            tk = b.top_k[rrows]
            if (tk > 0).any():
                top_k = upload(np.where(tk > 0, tk, self.vocab_size), dev)
            tp = b.top_p[rrows]
            if (tp < 1.0).any():
                top_p = upload(tp, dev)
            mp = b.min_p[rrows]
            if (mp > 0.0).any():
                min_p = upload(mp, dev)
            for i, r in enumerate(rrows):
                if samples is not None and not samples[lreq[i]]:
                    continue  # a prompt chunk short of its end: its row samples nothing
                gen = b.generators.get(int(r))
                if gen is not None:
                    generators[i] = gen
        # min_tokens: ban EOS / stop ids until enough tokens were produced
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i in np.flatnonzero(b.min_tokens[rrows]).tolist():
            r, j = rrows[i], lreq[i]
            # outputs before this row's sample, counting one still in flight
            done = (
                max(b.num_tokens[r], b.num_computed[r] + nsched[j] - ndraft[j])
                - b.num_prompt_tokens[r]
                + offset[i]
            )
            if done < b.min_tokens[r]:
                ban_rows.extend([i] * len(b.banned_ids[r]))
                ban_ids.extend(b.banned_ids[r])
        banned = None
        if ban_rows:
            banned = (
                upload(np.asarray(ban_rows, dtype=np.int64), dev),
                upload(np.asarray(ban_ids, dtype=np.int64), dev),
            )
        num_lp = b.logprobs[rrows]
        need_lp = bool((num_lp >= 0).any())
        num_top = int(num_lp.max(initial=0))
        return SamplingMetadata(
            all_greedy,
            temperature,
            greedy_rows,
            top_k,
            top_p,
            min_p,
            generators,
            banned,
            need_lp,
            num_top_logprobs=num_top,
            bias=self._bias(rrows),
            allowed=self._allowed(rrows),
            penalties=penalties(
                self.batch, self.buf, self.state, rrows, lreq, nsched, ndraft, offset
            ),
        )

    def _bias(self, rrows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(logits rows, token ids, values) of the rows' ``logit_bias``; every logits row
        of a request (a verify has several) gets the request's bias."""
        hit = np.flatnonzero(self.batch.has_bias[rrows])
        if not len(hit):
            return None
        parts = [(int(i), bv) for i in hit if (bv := self.batch.bias[rrows[i]]) is not None]
        rows = np.concatenate([np.full(len(bv[0]), i, dtype=np.int64) for i, bv in parts])
        ids = np.concatenate([bv[0] for _, bv in parts])
        vals = np.concatenate([bv[1] for _, bv in parts])
        dev = self.device
        return upload(rows, dev), upload(ids, dev), upload(vals, dev)

    def _allowed(self, rrows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(restricted rows mask, logits rows, allowed ids) of ``allowed_token_ids``."""
        hit = np.flatnonzero(self.batch.has_allowed[rrows])
        if not len(hit):
            return None
        parts = [(int(i), a) for i in hit if (a := self.batch.allowed_ids[rrows[i]]) is not None]
        restricted = np.zeros(len(rrows), dtype=bool)
        restricted[[i for i, _ in parts]] = True
        rows = np.concatenate([np.full(len(a), i, dtype=np.int64) for i, a in parts])
        ids = np.concatenate([a for _, a in parts])
        dev = self.device
        return upload(restricted, dev), upload(rows, dev), upload(ids, dev)

    def with_masks(
        self,
        md: SamplingMetadata,
        so: SchedulerOutput,
        req_ids: list[str],
        last_row: np.ndarray,
        num_drafts: np.ndarray,
    ) -> SamplingMetadata:
        """``md`` with the step's structured-output bitmask on the logits rows of the
        requests it applies to (a verify's every position) and bad-word bans on their
        sampled row (each request's last logits row)."""
        if so.grammar_bitmask is None and not so.bad_word_bans:
            return md
        index = {rid: i for i, rid in enumerate(req_ids)}
        if so.bad_word_bans:
            rows = [last_row[index[r]] for r, ids in so.bad_word_bans.items() for _ in ids]
            ids = [t for banned in so.bad_word_bans.values() for t in banned]
            extra = (
                upload(np.asarray(rows, dtype=np.int64), self.device),
                upload(np.asarray(ids, dtype=np.int64), self.device),
            )
            if md.banned is not None:
                extra = (torch.cat([md.banned[0], extra[0]]), torch.cat([md.banned[1], extra[1]]))
            md.banned = extra
        if so.grammar_bitmask is None:
            return md
        # a verify's request has a row per position: row_start .. its last row
        at = [index[r] for r in so.structured_req_ids]
        lrows = np.concatenate(
            [np.arange(last_row[i] - num_drafts[i], last_row[i] + 1) for i in at]
        ).astype(np.int64)
        md.grammar = (upload(lrows, self.device), upload(so.grammar_bitmask, self.device))
        return md
