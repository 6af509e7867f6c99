"""The step pipeline: one ``SchedulerOutput`` through the runner, phase by phase.

1. **prepare**: the rows follow the scheduler output; the step's inputs are built on
   the host and completed on the device from the request state
   (:mod:`pdserve.runner.step_inputs`, :mod:`pdserve.runner.request_state`); sampling
   parameters, penalties, logit bias and min_tokens bans are built here.
2. **forward**: a CUDA graph replay or an eager forward; the DP dummy forward when
   this rank has nothing scheduled but a peer has; prompt logprobs scored right after.
3. **land**: the step before finishes (the engine's ``land`` hook: results read on the
   host, handed to the scheduler) while this one's forward runs.
4. **masks**: grammar bitmask and bad-word bans (the engine's ``masks`` hook fills them
   now if the scheduler left them for after landing).
5. **sample**: penalties, bias, masks and filters applied, tokens sampled (drafts
   verified by rejection sampling), logprobs.
6. **propose**: the drafter's next drafts, on the device.
7. **update**: the request state's ``post_update``.
8. **copy out**: results copied to pinned host memory, an event recorded.

``depth`` is how many launched steps stay in flight when :meth:`StepPipeline.step`
returns: 0 (synchronous scheduling) lands each step at the end of its own call; 1
(asynchronous) lands it in the land phase of the next call. At depth 0 without a
drafter the update phase is skipped: the next step's inputs are all known to the host
by the time it is prepared. A tensor-parallel follower runs phases 1-2 and 4-8 of every
step its leader broadcasts (:meth:`launch`) at depth 1 (it may launch a step before the
one before has landed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from pdserve.core_types.scheduler_output import EngineCoreOutput, RunnerOutput, SchedulerOutput
from pdserve.distributed.dp_sync import StepPlan
from pdserve.layers.sampler import top_logprobs
from pdserve.runner.dummy_step import plan_graph_key
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.prompt_logprobs import piece_rows, plan_prompt_logprobs, score_prompt_rows
from pdserve.runner.step_inputs import StepInputs
from pdserve.runner.step_outputs import HostOutputs, StepHandle, copy_out, ragged
from pdserve.spec_decode.proposer import DraftBatch, drafts_to_propose
from pdserve.spec_decode.rejection_sampler import rejection_sample, token_logprobs

Land = Callable[[SchedulerOutput, RunnerOutput], list[EngineCoreOutput]]


def _record(timing: bool) -> torch.cuda.Event:
    """A CUDA event recorded on the current stream (``timing``: one that can time)."""
    event = torch.cuda.Event(enable_timing=timing)
    event.record()
    return event


class StepPipeline:
    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        self.depth = 0
        self.steps = 0  # steps launched
        self.in_flight: deque[tuple[SchedulerOutput, StepHandle]] = deque()
        pin = runner.device.type == "cuda"
        # two slots alternate: a step's results land in one while the next step is launched
        self.host = [HostOutputs(runner.max_num_reqs, runner.num_spec + 1, pin) for _ in range(2)]
        self.slot = 0
        # seconds the host spent blocked on launched steps (a step's wait for the device:
        # near 0 a step means the host, not the device, sets the pace)
        self.waited_s = 0.0
        # steps timed on the device for the adaptive draft policy (the only reader)
        self.timed = runner.device.type == "cuda" and runner.adaptive_drafts
        self._last_done: torch.cuda.Event | None = None  # the last timed step's end

    # -- the engine's step ------------------------------------------------------------------
    def step(
        self,
        so: SchedulerOutput,
        plan: StepPlan | None,
        land: Land,
        masks: Callable[[SchedulerOutput], None],
        launch: Callable[[Callable[[], StepHandle]], StepHandle] = lambda run: run(),
    ) -> list[EngineCoreOutput]:
        """Run ``so`` through every phase; returns the outputs of the steps that landed.
        ``launch`` wraps the launch (a TP leader broadcasts the step first)."""
        landed: list[EngineCoreOutput] = []

        def between() -> None:  # phases 3 and 4
            while self.in_flight:
                landed.extend(self._land(land))
            masks(so)

        self.in_flight.append((so, launch(lambda: self.launch(so, plan, between))))
        while len(self.in_flight) > self.depth:
            landed.extend(self._land(land))
        return landed

    def drain(self, land: Land) -> list[EngineCoreOutput]:
        """Land every step in flight."""
        out: list[EngineCoreOutput] = []
        while self.in_flight:
            out.extend(self._land(land))
        return out

    def _land(self, land: Land) -> list[EngineCoreOutput]:
        so, handle = self.in_flight.popleft()
        return land(so, self.finish(handle))

    # -- the phases -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self,
        so: SchedulerOutput,
        plan: StepPlan | None = None,
        between: Callable[[], None] | None = None,
    ) -> StepHandle:
        """Phases 1-8 of ``so`` (``between`` is phases 3-4's hooks); returns without
        waiting for the device."""
        r = self.r
        if r.lockstep and plan is None:
            raise RuntimeError("an expert-parallel runner needs the DP step plan every step")
        self.steps += 1
        r.update_rows(so, self.steps)
        if so.is_empty:
            path = self._dummy_forward(plan) if plan is not None and plan.any_busy else "eager"
            if between is not None:
                between()
            return StepHandle(None, path)
        start = _record(timing=True) if self.timed else None
        # the state records this step only where the next may be prepared before it lands
        keep_state = self.depth > 0 or r.state.drafting
        inp = r.prep.prepare(so, self.steps, keep_state)
        hidden, logits, path = self.forward(inp, plan)
        prompt_plan = plan_prompt_logprobs(
            inp.req_ids,
            inp.rows,
            inp.num_scheduled,
            r.batch.num_computed,
            r.batch.num_prompt_tokens,
            r.batch.prompt_logprobs,
            r.batch.token_ids,
            r.device,
        )
        scored = None
        if prompt_plan is not None:
            rows = piece_rows(r.vocab_size)
            scored = score_prompt_rows(hidden, prompt_plan, r.step.logits, rows)
        if between is not None:
            between()
        inp.sampling = r.prep.sampling.with_masks(
            inp.sampling, so, inp.req_ids, inp.last_rows, inp.num_drafts
        )
        tokens, num, lp = self.sample(inp, logits)
        top = self._top_logprobs(inp, logits, tokens.shape[1])
        drafts = self.propose(inp, hidden, tokens, num)
        if keep_state:
            num_rows = inp.num_rows if inp.drafts is not None else None
            r.state.post_update(
                inp.rows_dev, inp.nsched_dev, num_rows, inp.sample_mask, tokens, num, drafts
            )
        self.slot ^= 1
        host = self.host[self.slot]
        copied = copy_out(host, tokens, num, lp, drafts, top, scored, r.max_num_tokens)
        done = _record(timing=self.timed) if r.device.type == "cuda" else None
        return StepHandle(inp, path, copied, done, prompt_plan, start)

    def finish(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return what it accepted (the step's one host sync)."""
        inp, c = handle.inp, handle.copied
        if inp is None or c is None:
            return RunnerOutput([], [], step_path=handle.path)
        device_s = None
        if handle.done_event is not None:
            t = time.perf_counter()
            handle.done_event.synchronize()
            self.waited_s += time.perf_counter() - t
            if handle.start_event is not None:
                device_s = self._device_time(handle.start_event, handle.done_event)
        samples = inp.samples
        tokens = c.tokens.numpy()
        per = c.num.numpy() if c.num is not None else None
        num = per if per is not None else np.ones(len(samples), dtype=np.int64)
        self.r.batch.record(inp.rows, inp.step, tokens, np.where(samples, num, 0))
        out = RunnerOutput(
            inp.req_ids, ragged(tokens, per, samples), step_path=handle.path, device_s=device_s
        )
        if c.logprobs is not None:
            out.logprobs = ragged(c.logprobs.numpy(), per, samples)
        if c.drafts is not None:
            d = c.drafts.numpy()
            out.draft_token_ids = [d[i].tolist() if samples[i] else [] for i in range(len(d))]
        if c.top is not None:
            out.top_token_ids = ragged(c.top[0].numpy(), per, samples)
            out.top_logprobs = ragged(c.top[1].numpy(), per, samples)
        if c.prompt is not None and handle.prompt_plan is not None:
            out.prompt_logprobs = c.prompt.read(handle.prompt_plan)
        return out

    def _device_time(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Seconds the device spent on a landed step: from its start, or the end of the
        step that landed before it if that was later (steps queue behind each other), to
        its end. Steps land in launch order, so that one's end is recorded before."""
        ms = start.elapsed_time(end)
        if self._last_done is not None:
            ms = min(ms, self._last_done.elapsed_time(end))
        self._last_done = end
        return ms / 1e3

    def _dummy_forward(self, plan: StepPlan) -> str:
        """An idle rank's forward for a step a peer computes (see ``dummy_step``)."""
        r = self.r
        assert r.dummy is not None
        key = plan_graph_key(r.graphs, plan)
        r._graph_key = None
        if key is None:
            r.dummy.run_eager()
            return "dummy:eager"
        assert r.graphs is not None
        r.prep.wait_staging()  # fill_padding rewrites the pinned staging buffers
        r.dummy.run_graph(r.graphs, r.draft_graphs, key)
        r.prep.mark_staging_read()
        return "dummy:graph"

    def forward(
        self, inp: StepInputs, plan: StepPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(hidden states of every scheduled token, logits of the sampled rows, path),
        from a graph replay or an eager forward.

        The path is "graph", or "eager:<why>": graphs_off, not_uniform_decode (a prompt,
        a chunk or a mixed batch; with a DP ``plan``: on any busy rank), no_graph_for_shape
        (more requests than the largest capture; with a plan: on the busiest rank)."""
        r = self.r
        nreq, t = len(inp.req_ids), inp.num_tokens
        q = inp.uniform_query_len if plan is None else plan.uniform_q
        size = nreq if plan is None else plan.max_reqs
        r._graph_key = None
        if r.graphs is None:
            path = "eager:graphs_off"
        elif q is None or q not in r.graphs.query_lens:
            path = "eager:not_uniform_decode"  # prompts, chunks, mixed batches
        else:
            padded = r.graphs.padded_size(size, q)
            if padded is not None:
                width = r.graphs.width_for(inp.common.max_seq_len if plan is None else None)
                r._graph_key = (padded, q, width)
                r.buffers.fill_padding(nreq, t, padded, q)
                r.prep.mark_staging_read()
                hidden, logits = r.graphs.replay(padded, q, width)
                return hidden[:t], self._logit_rows(inp, logits), "graph"
            path = "eager:no_graph_for_shape"
        r.prep.mark_staging_read()
        hidden = r.step.hidden(inp.common)
        return hidden, r.step.logits(self._logit_rows(inp, hidden)), path

    @staticmethod
    def _logit_rows(inp: StepInputs, x: torch.Tensor) -> torch.Tensor:
        """The sampled rows of per-token ``x`` (a graph's logits, or hidden states)."""
        return x[: inp.num_logit_rows] if inp.logits_idx is None else x[inp.logits_idx]

    def sample(
        self, inp: StepInputs, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens [B, w], accepted counts [B] or None when all are 1, logprobs [B, w])."""
        r, md = self.r, inp.sampling
        if inp.drafts is None:
            sampled, lp = r.sampler(logits, md)
            return sampled.unsqueeze(1), None, lp.unsqueeze(1) if lp is not None else None
        tokens, num = rejection_sample(
            r.sampler,
            logits,
            md,
            inp.drafts,
            inp.row_start,
            inp.num_rows,
            r.rejection_method,
            r.synthetic_rate,
        )
        lp = token_logprobs(logits, tokens, inp.row_start) if md.need_logprobs else None
        return tokens, num, lp

    @staticmethod
    def _top_logprobs(
        inp: StepInputs, logits: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, logprobs) [B, width, N] of each sampled position's top-N, when asked."""
        n = inp.sampling.num_top_logprobs
        if not n:
            return None
        ids, lps = top_logprobs(logits, n)
        if inp.drafts is None:
            return ids.unsqueeze(1), lps.unsqueeze(1)
        ar = torch.arange(width, device=logits.device)
        rows = (inp.row_start[:, None] + ar[None, :]).clamp(max=logits.shape[0] - 1)
        return ids[rows], lps[rows]

    def propose(
        self,
        inp: StepInputs,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        num: torch.Tensor | None,
    ) -> torch.Tensor | None:
        r = self.r
        if r.proposer is None or not inp.propose:
            return None
        n = len(inp.req_ids)
        counts = num if num is not None else torch.ones(n, dtype=torch.int64, device=r.device)
        dg = r.draft_graphs
        if dg is not None and r._graph_key in dg.graphs:
            key = r._graph_key
            assert inp.sample_mask is not None  # uploaded wherever there is a drafter
            return dg.run(key, tokens, counts, inp.first_token, inp.next_ids, inp.sample_mask)
        b, buf = r.batch, r.buffers
        batch = DraftBatch(
            req_ids=inp.req_ids,
            rows=inp.rows,
            samples=inp.samples,
            token_table=b.token_ids,
            num_prompt_tokens=b.num_prompt_tokens[inp.rows],
            num_known=b.num_tokens[inp.rows],
            max_context=inp.common.max_seq_len + 1,
            sampled=tokens,
            num_sampled=counts,
            next_positions=buf.positions.dev.index_select(0, inp.first_token) + counts,
            hidden=hidden,
            query_start_loc=inp.common.query_start_loc,
            input_ids=buf.input_ids.dev[: inp.num_tokens],
            positions=buf.positions.dev[: inp.num_tokens],
            common=inp.common,
            first_token=inp.first_token,
            num_rows=inp.num_rows,
            last_next_ids=inp.next_ids,
            block_tables=buf.block_tables.dev[:n],
            sample_mask=inp.sample_mask,
            num_drafts=drafts_to_propose(inp.uniform_query_len, r.adaptive_drafts),
        )
        return r.proposer.propose(batch)
