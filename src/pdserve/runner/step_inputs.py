"""Batch prep: one ``SchedulerOutput`` -> the step's inputs in the static buffers.

Numpy over the batch's rows builds the flat token arrays (ids, positions, slots), the
attention metadata and the per-row sampling parameters, then uploads them. Under
async scheduling some inputs exist only on the device, produced by the step still in
flight: its last accepted token per request, the drafts it proposed, and (when it
verified drafts) how many it accepted, which moves every position of the request by
the number rejected. :meth:`StepPreparer.prepare` patches those in on the device after
the uploads, so the host never waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.core_types.scheduler_output import SchedulerOutput
from pdserve.core_types.utils import cdiv
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.layers.sampler import SamplingMetadata
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers, upload
from pdserve.runner.penalty_counts import penalties


@dataclass
class StepInputs:
    req_ids: list[str]
    rows: np.ndarray  # [B] InputBatch rows
    num_scheduled: np.ndarray  # [B]
    num_drafts: np.ndarray  # [B] drafts among each request's scheduled tokens
    samples: np.ndarray  # [B] bool: the request reaches its end and samples
    uniform_query_len: int | None  # q when every request computes exactly q tokens
    num_tokens: int
    common: CommonAttentionMetadata
    # logits rows: request b's rows are row_start[b] .. +num_drafts[b]; row r is token
    # logits_idx[r] (None: rows are tokens 0..num_logit_rows-1, i.e. every token)
    num_logit_rows: int
    logits_idx: torch.Tensor | None
    # per request, on the device, when drafts are verified or a proposer runs (else None):
    row_start: torch.Tensor | None  # [B] its first logits row
    num_rows: torch.Tensor | None  # [B] its logits rows
    first_token: torch.Tensor | None  # [B] token index of its first logits row
    next_ids: torch.Tensor | None  # [B] the known token after its last one, -1: none yet
    sample_mask: torch.Tensor | None  # [B] bool, device: ``samples`` (when a proposer runs)
    drafts: torch.Tensor | None  # [B, k] int64, device, when any request verifies drafts
    sampling: SamplingMetadata
    row_gens: np.ndarray  # the rows' generations when the step was prepared
    last_rows: np.ndarray  # [B] each request's last logits row (the one it samples from)
    propose: bool = True  # the drafter runs after this step (SchedulerOutput.propose_drafts)


@dataclass
class InFlight:
    """What the last launched step left on the device for the next one."""

    tokens: torch.Tensor  # [B, k+1] accepted tokens (-1 padded)
    num: torch.Tensor | None  # [B] accepted counts; None when every count is 1
    drafts: torch.Tensor | None  # [B, k] proposed drafts
    index: np.ndarray  # [max_num_reqs] row -> its batch index in that step, -1: sampled none
    # [max_num_reqs] row -> tokens it verified (drafts + 1); None when no row had drafts
    num_rows: np.ndarray | None
    # [max_num_reqs] row -> its generation when the step was prepared (-1: not in it);
    # a row handed to another request since then has nothing to take from this step
    row_gens: np.ndarray


class StepPreparer:
    def __init__(
        self,
        batch: InputBatch,
        buffers: InputBuffers,
        device: torch.device,
        vocab_size: int,
        drafting: bool = False,
        lookahead: int = 0,
    ) -> None:
        self.drafting = drafting  # a proposer runs after every step (it reads first_token)
        # block-table columns past the step that a drafter writes (MTP's lookahead slots)
        self.lookahead = lookahead
        self.batch = batch
        self.buf = buffers
        self.device = device
        self.vocab_size = vocab_size
        self.in_flight: InFlight | None = None
        # set once a step's host->device copies are enqueued; the next step waits on it
        # before it rewrites the pinned staging buffers those copies read
        self._staging_free: torch.cuda.Event | None = None

    def mark_staging_read(self) -> None:
        """Called once the step's last host->device copy is enqueued."""
        if self.device.type == "cuda":
            if self._staging_free is None:
                self._staging_free = torch.cuda.Event()
            self._staging_free.record()

    def wait_staging(self) -> None:
        """Block until the previous step's uploads have read the pinned staging buffers."""
        if self._staging_free is not None:
            self._staging_free.synchronize()

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        b, buf = self.batch, self.buf
        self.wait_staging()  # the previous step's uploads have been read
        req_ids = list(so.num_scheduled_tokens)
        nreq = len(req_ids)
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=nreq)
        nsched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=nreq)
        t = int(nsched.sum())
        cu = np.zeros(nreq + 1, dtype=np.int64)
        np.cumsum(nsched, out=cu[1:])
        req_idx = np.repeat(np.arange(nreq), nsched)
        q_idx = np.arange(t) - cu[:-1][req_idx]
        computed = b.num_computed[rows]
        tok_rows = rows[req_idx]
        pos = computed[req_idx] + q_idx
        seq_lens = computed + nsched

        ndraft = np.zeros(nreq, dtype=np.int64)
        dmat = buf.drafts.np[:nreq]
        spec = so.scheduled_spec_decode_tokens
        known = b.token_ids[tok_rows, np.minimum(pos, b.token_ids.shape[1] - 1)]
        is_draft = draft_j = None
        if spec:
            dmat[:] = -1
            index = {rid: i for i, rid in enumerate(req_ids)}
            for rid, d in spec.items():
                i = index[rid]
                ndraft[i] = len(d)
                dmat[i, : len(d)] = d
            draft_j = q_idx - (nsched - ndraft)[req_idx]  # >= 0 on draft slots
            is_draft = draft_j >= 0
            draft_vals = dmat[req_idx, np.clip(draft_j, 0, dmat.shape[1] - 1)]
            buf.input_ids.np[:t] = np.where(is_draft, np.maximum(draft_vals, 0), known)
        else:
            buf.input_ids.np[:t] = known
        buf.positions.np[:t] = pos
        bs = buf.block_size
        buf.slots.np[:t] = b.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        buf.req_idx.np[:t] = req_idx
        buf.q_idx.np[:t] = q_idx
        buf.query_start_loc.np[: nreq + 1] = cu
        buf.seq_lens.np[:nreq] = seq_lens
        max_seq = int(seq_lens.max())
        nblk = min(cdiv(max_seq + self.lookahead, bs), b.block_table.shape[1])
        buf.block_tables.np[:nreq, :nblk] = b.block_table[rows, :nblk]

        # logits rows: the last num_drafts + 1 tokens of each request
        if spec:
            nrows = ndraft + 1
            row_start = np.zeros(nreq, dtype=np.int64)
            np.cumsum(nrows[:-1], out=row_start[1:])
            num_logit_rows = int(nrows.sum())
            lreq = np.repeat(np.arange(nreq), nrows)
        else:  # one row per request
            nrows = np.ones(nreq, dtype=np.int64)
            row_start = lreq = np.arange(nreq)
            num_logit_rows = nreq
        first_tok = cu[1:] - nrows
        if num_logit_rows != t:  # else every token is a row, in order
            buf.logits_idx.np[:num_logit_rows] = (
                first_tok[lreq] + np.arange(num_logit_rows) - row_start[lreq] if spec else first_tok
            )
        common = CommonAttentionMetadata(
            num_reqs=nreq,
            num_actual_tokens=t,
            max_query_len=int(nsched.max()),
            max_seq_len=max_seq,
            block_size=bs,
            query_start_loc=buf.query_start_loc.upload(nreq + 1),
            seq_lens=buf.seq_lens.upload(nreq),
            block_tables=self._upload_block_tables(nreq, nblk),
            slot_mapping=buf.slots.upload(t),
            token_req_idx=buf.req_idx.upload(t),
            token_q_idx=buf.q_idx.upload(t),
        )
        buf.input_ids.upload(t)
        buf.positions.upload(t)
        logits_idx = buf.logits_idx.upload(num_logit_rows) if num_logit_rows != t else None
        drafts = buf.drafts.upload(nreq) if spec else None
        samples = np.fromiter((r in so.sampling_req_ids for r in req_ids), bool, count=nreq)
        sample_mask = None
        if self.drafting:
            buf.samples.np[:nreq] = samples
            sample_mask = buf.samples.upload(nreq)
        d_per_req: list[torch.Tensor | None] = [None, None, None, None]
        if spec or self.drafting:
            per_req = buf.per_req.np  # row_start | num_rows | first_token | next id
            per_req[:nreq] = row_start
            per_req[nreq : 2 * nreq] = nrows
            per_req[2 * nreq : 3 * nreq] = first_tok
            nxt = np.minimum(seq_lens, b.token_ids.shape[1] - 1)
            per_req[3 * nreq : 4 * nreq] = np.where(
                seq_lens < b.num_tokens[rows], b.token_ids[rows, nxt], -1
            )
            d_per_req = list(buf.per_req.upload(4 * nreq).view(4, nreq))

        if self.in_flight is not None:
            self._patch_from_device(
                req_idx, tok_rows, pos, is_draft, dmat, draft_j, rows, t, nreq, drafts
            )
        uniform = int(nsched[0]) if bool((nsched == nsched[0]).all()) else None
        last_rows = row_start + ndraft
        return StepInputs(
            req_ids,
            rows,
            nsched,
            ndraft,
            samples,
            uniform,
            t,
            common,
            num_logit_rows,
            logits_idx,
            d_per_req[0],
            d_per_req[1],
            d_per_req[2],
            d_per_req[3],
            sample_mask,
            drafts,
            self._with_grammar(
                self.sampling_metadata(rows, nsched, ndraft, lreq, row_start, samples),
                so,
                req_ids,
                last_rows,
                ndraft,
            ),
            b.row_gen[rows].copy(),
            last_rows,
            so.propose_drafts,
        )

    def apply_masks(self, inp: StepInputs, so: SchedulerOutput) -> None:
        """Add the bitmask and bans filled after the step was prepared (``so`` with
        ``masks_deferred``) to its sampling metadata."""
        inp.sampling = self._with_grammar(
            inp.sampling, so, inp.req_ids, inp.last_rows, inp.num_drafts
        )

    def _with_grammar(
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

    def _upload_block_tables(self, nreq: int, nblk: int) -> torch.Tensor:
        bt = self.buf.block_tables
        bt.dev[:nreq, :nblk].copy_(bt.host[:nreq, :nblk], non_blocking=True)
        return bt.dev[:nreq, :nblk]

    def _patch_from_device(
        self,
        req_idx: np.ndarray,
        tok_rows: np.ndarray,
        pos: np.ndarray,
        is_draft: np.ndarray | None,  # None: no drafts this step
        dmat: np.ndarray,
        draft_j: np.ndarray | None,
        rows: np.ndarray,
        t: int,
        nreq: int,
        drafts: torch.Tensor | None,
    ) -> None:
        """Fill in the inputs the step in flight produces: each request's last accepted
        token, its drafts (where the host has none), and (after a verify) the positions,
        sequence lengths and slots moved back by the drafts it rejected."""
        prev = self.in_flight
        assert prev is not None
        b, buf = self.batch, self.buf
        # rows still held by the request the step in flight computed for them
        index = np.where(prev.row_gens == b.row_gen, prev.index, -1)
        src_of_tok = index[tok_rows]
        bonus = pos >= b.num_tokens[tok_rows]
        pend_draft = None
        if is_draft is not None and draft_j is not None:
            bonus &= ~is_draft
            if prev.drafts is not None and drafts is not None:
                unknown = dmat[req_idx, np.clip(draft_j, 0, dmat.shape[1] - 1)] < 0
                pend_draft = is_draft & (src_of_tok >= 0) & unknown
        src_of_req = index[rows]
        corr = None
        if prev.num_rows is not None:  # the step in flight verified drafts
            corr = (src_of_req >= 0) & (prev.num_rows[rows] > 1)
        if not (
            bonus.any()
            or (pend_draft is not None and pend_draft.any())
            or (corr is not None and corr.any())
        ):
            return
        b_dst = np.flatnonzero(bonus)
        b_src = src_of_tok[b_dst]
        if (b_src < 0).any():
            raise RuntimeError("a step needs a token that no step in flight samples")
        none = np.zeros(0, dtype=np.int64)
        d_dst = np.flatnonzero(pend_draft) if pend_draft is not None else none
        c_req = np.flatnonzero(corr) if corr is not None else none
        parts = [
            b_dst,
            b_src,
            d_dst,
            src_of_tok[d_dst],
            draft_j[d_dst] if draft_j is not None else none,
            req_idx[d_dst],
            c_req,
            src_of_req[c_req],
            prev.num_rows[rows[c_req]] if prev.num_rows is not None else none,
        ]
        sizes = [len(p) for p in parts]
        packed = np.concatenate(parts)
        buf.patch.np[: len(packed)] = packed
        dev = buf.patch.upload(len(packed))
        pieces = torch.split(dev, sizes)
        ids = buf.input_ids.dev
        last = (
            prev.tokens[:, 0]
            if prev.num is None
            else prev.tokens.gather(1, (prev.num - 1).unsqueeze(1)).squeeze(1)
        )
        if sizes[0]:
            ids.index_copy_(0, pieces[0], last.index_select(0, pieces[1]))
        if sizes[2]:
            assert prev.drafts is not None and drafts is not None
            vals = prev.drafts[pieces[3], pieces[4]]
            ids.index_copy_(0, pieces[2], vals.clamp(min=0))
            drafts[pieces[5], pieces[4]] = vals
        if sizes[6]:
            assert prev.num is not None
            delta = torch.zeros(nreq, dtype=torch.int64, device=ids.device)
            delta.index_copy_(0, pieces[6], prev.num.index_select(0, pieces[7]) - pieces[8])
            positions = buf.positions.dev[:t]
            positions += delta[buf.req_idx.dev[:t]]
            buf.seq_lens.dev[:nreq] += delta.to(torch.int32)
            bs = buf.block_size
            bt = buf.block_tables.dev
            buf.slots.dev[:t] = (
                bt[buf.req_idx.dev[:t], positions // bs].to(torch.int64) * bs + positions % bs
            )

    def record_launch(
        self,
        inp: StepInputs,
        tokens: torch.Tensor,
        num: torch.Tensor | None,
        drafts: torch.Tensor | None,
    ) -> InFlight:
        """Remember what the step just launched leaves on the device for the next one."""
        n = self.batch.max_num_reqs
        index = np.full(n, -1, dtype=np.int64)
        index[inp.rows] = np.where(inp.samples, np.arange(len(inp.rows)), -1)
        num_rows = None
        if inp.drafts is not None:
            num_rows = np.zeros(n, dtype=np.int64)
            num_rows[inp.rows] = inp.num_drafts + 1
        gens = np.full(n, -1, dtype=np.int64)
        gens[inp.rows] = inp.row_gens
        self.in_flight = InFlight(tokens, num, drafts, index, num_rows, gens)
        return self.in_flight

    def landed(self, step: InFlight | None) -> None:
        """``step``'s results reached the host: nothing needs patching from it any more."""
        if step is not None and self.in_flight is step:
            self.in_flight = None

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
        params = [b.params[r] for r in rrows]
        greedy = np.fromiter(
            (p is not None and p.greedy for p in params), dtype=bool, count=len(rrows)
        )
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
        for i, (r, p) in enumerate(zip(rrows, params, strict=True)):
            if p is not None and p.min_tokens and b.banned_ids[r]:
                j = lreq[i]
                # outputs before this row's sample, counting one still in flight
                done = (
                    max(b.num_tokens[r], b.num_computed[r] + nsched[j] - ndraft[j])
                    - b.num_prompt_tokens[r]
                    + offset[i]
                )
                if done < p.min_tokens:
                    ban_rows.extend([i] * len(b.banned_ids[r]))
                    ban_ids.extend(b.banned_ids[r])
        banned = None
        if ban_rows:
            banned = (
                upload(np.asarray(ban_rows, dtype=np.int64), dev),
                upload(np.asarray(ban_ids, dtype=np.int64), dev),
            )
        need_lp = any(p is not None and p.logprobs is not None for p in params)
        num_top = max((p.logprobs or 0 for p in params if p is not None), default=0)
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
                self.batch, self.buf, self.in_flight, rrows, params, lreq, nsched, ndraft, offset
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
