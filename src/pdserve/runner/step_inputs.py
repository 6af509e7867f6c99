"""Batch prep: one ``SchedulerOutput`` -> the step's inputs in the static buffers.

Numpy over the batch's rows builds the flat token arrays (ids, positions, slots) and
the attention metadata, then uploads them. The inputs only the device knows (each
row's last sampled token, the drafts proposed for it, and with a drafter the positions
its rejected drafts moved back) are then filled from the
:class:`~pdserve.runner.request_state.RequestState`, on the device, in stream order.
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
from pdserve.runner.input_buffers import PACKED_SEGMENTS, InputBuffers
from pdserve.runner.request_state import RequestState, draft_slots
from pdserve.runner.sampling_inputs import SamplingInputs


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
    lreq: np.ndarray  # [R] each logits row's request
    row_start_np: np.ndarray  # [B] each request's first logits row
    # per request, on the device
    rows_dev: torch.Tensor  # [B]
    nsched_dev: torch.Tensor  # [B]
    row_start: torch.Tensor  # [B] its first logits row
    num_rows: torch.Tensor  # [B] its logits rows
    first_token: torch.Tensor  # [B] token index of its first logits row
    next_ids: torch.Tensor  # [B] the known token after its last one, -1: none yet
    sample_mask: torch.Tensor | None  # [B] bool: ``samples`` (with a drafter)
    drafts: torch.Tensor | None  # [B, k] int64, when any request verifies drafts
    sampling: SamplingMetadata  # the masks phase adds the grammar bitmask and bad words
    step: int  # the runner's step number (rows added later are not this step's)
    propose: bool = True  # the drafter runs after this step (SchedulerOutput.propose_drafts)

    @property
    def last_rows(self) -> np.ndarray:
        """[B] each request's last logits row (the one it samples from)."""
        return self.row_start_np + self.num_drafts


class StepPreparer:
    def __init__(
        self,
        batch: InputBatch,
        buffers: InputBuffers,
        state: RequestState,
        device: torch.device,
        vocab_size: int,
        lookahead: int = 0,
    ) -> None:
        # block-table columns past the step that a drafter writes (MTP's lookahead slots)
        self.lookahead = lookahead
        self.batch = batch
        self.buf = buffers
        self.state = state
        self.device = device
        self.sampling = SamplingInputs(batch, buffers, state, device, vocab_size)
        # set once a step's host->device copies are enqueued; the next step waits on it
        # before it rewrites the pinned staging buffers those copies read
        self._staging_free: torch.cuda.Event | None = None
        self._nothing = torch.empty(0, dtype=torch.int64, device=device)

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

    def prepare(self, so: SchedulerOutput, step: int, keep_state: bool = True) -> StepInputs:
        """The step's inputs. ``keep_state``: the step will record itself in the request
        state (its ``post_update``) because the next step may be prepared before it lands;
        a synchronous step without a drafter does not, and then needs none of the
        per-request device indices unless its inputs need the state (they never do)."""
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
        pos = computed[req_idx] + q_idx  # the host's count: ahead by drafts to be rejected
        seq_lens = computed + nsched

        ndraft = np.zeros(nreq, dtype=np.int64)
        spec = so.scheduled_spec_decode_tokens
        k = buf.drafts.np.shape[1]
        is_draft = np.zeros(t, dtype=bool)
        draft_at = draft_flat = np.zeros(0, dtype=np.int64)
        if spec:
            dmat = buf.drafts.np[:nreq]
            dmat[:] = -2  # no draft; -1: proposed by the step before, read on the device
            index = {rid: i for i, rid in enumerate(req_ids)}
            for rid, d in spec.items():
                i = index[rid]
                ndraft[i] = len(d)
                dmat[i, : len(d)] = d
            is_draft, draft_at, draft_flat = draft_slots(q_idx, req_idx, nsched, ndraft, k)
        # inputs past the tokens the host knows (its landed ones) are the row's last
        # sampled token, read on the device; synchronous steps have none of them
        last_at = np.flatnonzero((pos >= b.num_tokens[tok_rows]) & ~is_draft)
        buf.input_ids.np[:t] = b.token_ids[tok_rows, np.minimum(pos, b.token_ids.shape[1] - 1)]
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
        nrows = ndraft + 1
        if spec:
            row_start = np.zeros(nreq, dtype=np.int64)
            np.cumsum(nrows[:-1], out=row_start[1:])
            num_logit_rows = int(nrows.sum())
            lreq = np.repeat(np.arange(nreq), nrows)
        else:  # one row per request
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
        if self.state.drafting:  # the drafter's and the state's (rows that sampled)
            buf.samples.np[:nreq] = samples
            sample_mask = buf.samples.upload(nreq)
        if keep_state or spec or len(last_at):  # keep_state: always with a drafter
            nxt = np.minimum(seq_lens, b.token_ids.shape[1] - 1)
            next_ids = np.where(seq_lens < b.num_tokens[rows], b.token_ids[rows, nxt], -1)
            # one upload: row_start | num_rows | first_token | next id | row | nsched,
            # then the request state's indices (new rows, their computed counts; token
            # indices whose input is the last sampled token, their request; draft slots,
            # flat index)
            new_rows = np.fromiter((b.row_of[n.req_id] for n in so.scheduled_new_reqs), np.int64)
            per = buf.packed.upload_packed(
                (row_start, nrows, first_tok, next_ids, rows, nsched, new_rows,
                 b.num_computed[new_rows], last_at, req_idx[last_at], draft_at, draft_flat)
            )  # fmt: skip
            if len(new_rows):
                self.state.reset(per[6], per[7])
            self.state.place(
                buf, per[4], per[5], t, per[8], per[9], drafts,
                per[10] if spec else None, per[11] if spec else None,
            )  # fmt: skip
        else:  # nothing on the device reads them: empty, so a reader would fail loudly
            per = [self._nothing] * PACKED_SEGMENTS
        uniform = int(nsched[0]) if bool((nsched == nsched[0]).all()) else None
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
            lreq,
            row_start,
            per[4],
            per[5],
            per[0],
            per[1],
            per[2],
            per[3],
            sample_mask,
            drafts,
            self.sampling.sampling_metadata(rows, nsched, ndraft, lreq, row_start, samples),
            step,
            so.propose_drafts,
        )

    def _upload_block_tables(self, nreq: int, nblk: int) -> torch.Tensor:
        bt = self.buf.block_tables
        bt.dev[:nreq, :nblk].copy_(bt.host[:nreq, :nblk], non_blocking=True)
        return bt.dev[:nreq, :nblk]
