"""The model runner: turns a ``SchedulerOutput`` into one forward pass and accepted tokens.

Three layers of batch state: the scheduler's requests (CPU objects), the runner's
``InputBatch`` rows (numpy), and this step's device tensors, written into the static
:class:`~pdserve.runner.input_buffers.InputBuffers` (so CUDA graphs replay over them).
Batch prep is numpy over rows (:mod:`pdserve.runner.step_inputs`); the only host sync
per step is reading the accepted tokens back.

A step computes ``num_scheduled_tokens`` per request; requests that reach their end
sample. With a proposer (speculative decoding) the last ``num_drafts`` of a request's
tokens are drafts: the logits of the last ``num_drafts + 1`` positions go through the
rejection sampler, which accepts a prefix of the drafts plus one token, and the
proposer drafts the next step's tokens from what was accepted, on the device.

Data parallelism: each DP rank has its own runner on its own device (``groups``). Under
expert parallelism (``lockstep``) every :meth:`ModelRunner.launch` gets the step's
:class:`~pdserve.distributed.dp_sync.StepPlan`: the graph decision follows the plan (all
ranks replay the same graph or all run eagerly), and a rank with nothing scheduled runs
a dummy forward (:mod:`pdserve.runner.dummy_step`) whenever a peer runs a real one.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.core_types.cache_spec import KVCacheConfig
from pdserve.core_types.scheduler_output import RunnerOutput, SchedulerOutput
from pdserve.core_types.utils import cdiv
from pdserve.distributed.dp_sync import StepPlan
from pdserve.distributed.groups import ParallelGroups
from pdserve.forward_context import KVCaches
from pdserve.layers.moe import MoE
from pdserve.layers.sampler import Sampler, top_logprobs
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.draft_graph import DraftGraphManager
from pdserve.runner.dummy_step import DummyStep, plan_graph_key
from pdserve.runner.graph_costs import time_step_costs
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers
from pdserve.runner.memory import (
    CPU_DEFAULT_KV_BYTES,
    kv_budget_bytes,
    resolve_device,
)
from pdserve.runner.model_step import ModelStep, collect_cache_layers
from pdserve.runner.prompt_logprobs import (
    PromptLogprobsPlan,
    Scored,
    piece_rows,
    plan_prompt_logprobs,
    score_prompt_rows,
)
from pdserve.runner.step_inputs import StepInputs, StepPreparer
from pdserve.runner.step_outputs import Forwarded, HostOutputs, StepHandle, ragged
from pdserve.runner.warmup import dummy_prompt_run, warm_up
from pdserve.spec_decode.build import build_proposer
from pdserve.spec_decode.mtp import MTPProposer
from pdserve.spec_decode.proposer import DraftBatch, Proposer
from pdserve.spec_decode.rejection_sampler import rejection_sample, token_logprobs

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, KV cache and step machinery. Under tensor parallelism every rank
    of the group builds one (``groups``: this rank's) and runs the identical sequence of
    calls (start-up, then each step's ``launch``/``finish``): forwards are collective."""

    def __init__(
        self,
        config: EngineConfig,
        proposer: Proposer | None = None,
        groups: ParallelGroups | None = None,
    ) -> None:
        from pdserve.models.loader import load_model

        self.config = config
        self.groups = groups if groups is not None else ParallelGroups()
        # a rank's process put its own device into the config (core_proc, tp_workers)
        self.device = resolve_device(config.device.device)
        self._free_at_start = 0
        if self.device.type == "cuda":
            torch.cuda.init()
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        spec = config.speculative
        options: dict[str, object] = {"groups": self.groups}
        if spec is not None and spec.method == "mtp":
            options["with_mtp"] = True
        self.model, self.hf_config = load_model(
            config.model.model,
            config.model.dtype,
            self.device,
            load_format=config.model.load_format,
            seed=config.model.seed,
            quantization=config.model.quantization,
            **options,
        )
        self.model.eval()
        # expert parallelism: MoE layers are collectives, every step runs on every rank
        self.lockstep = self.groups.ep.size > 1 and any(
            isinstance(m, MoE) for m in self.model.modules()
        )
        self.dtype = self.model.dtype  # FP8 linears keep their activations in this dtype
        self.load_seconds = time.perf_counter() - t0
        hc = self.hf_config
        self.vocab_size = int(hc.vocab_size)
        self.max_model_len = int(config.model.max_model_len or hc.max_position_embeddings)
        if self.max_model_len > hc.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {hc.max_position_embeddings}"
            )
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.proposer = proposer  # an injected drafter; else built from the config below
        if proposer is not None:
            self.num_spec = proposer.num_speculative_tokens
        else:
            self.num_spec = spec.num_speculative_tokens if spec is not None else 0
        self.rejection_method = spec.rejection_sample_method if spec else "probabilistic"
        self.synthetic_rate = (spec.synthetic_acceptance_rate or 0.0) if spec else 0.0
        kv_dtype = str(self.dtype).removeprefix("torch.")
        fp8_kv = "float8_e4m3fn" if config.cache.kv_cache_dtype.startswith("fp8") else None
        cache_config, group_layers = collect_cache_layers(
            self.model, self.block_size, kv_dtype, fp8_kv
        )
        choice = config.device.attention_backend
        backends = {
            g: layers[0].make_backend(choice, self.device, self.max_model_len)  # type: ignore[operator]
            for g, layers in group_layers.items()
        }
        self.buffers = InputBuffers(
            self.max_num_tokens,
            self.max_num_reqs,
            self.max_blocks_per_req,
            self.block_size,
            self.max_model_len,
            self.num_spec,
            self.device,
        )
        self.step = ModelStep(
            self.model,
            self.buffers,
            cache_config,
            group_layers,
            backends,
            self.device,
            self.dtype,
            self.max_model_len,
            self.vocab_size,
        )
        if self.proposer is None and spec is not None:
            self.proposer = build_proposer(
                spec,
                self.model,
                self.step.backends,
                lambda: self.kv_caches,
                self.max_num_reqs,
                self.max_model_len,
                self.device,
                self.hf_config.architecture,
            )
        # MTP drafts write their KV up to k positions past the step (lookahead slots)
        self.lookahead = self.num_spec if spec is not None and spec.method == "mtp" else 0
        # the per-step draft count (0..k) is the engine's choice, except where the ranks of
        # an expert-parallel step must run the same shapes (lockstep)
        self.adaptive_drafts = (
            self.num_spec > 0
            and (spec is None or spec.draft_policy == "adaptive")
            and not self.lockstep
        )
        # seconds per (padded size, drafts j, width), timed on the graphs at start-up
        self.step_costs: dict[tuple[int, int, int], float] = {}
        self.sampler = Sampler(self.device, config.model.seed)
        self.batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.vocab_size
        )
        self.prep = StepPreparer(
            self.batch,
            self.buffers,
            self.device,
            self.vocab_size,
            drafting=self.proposer is not None,
            lookahead=self.lookahead,
        )
        self.num_blocks = 0
        self.graphs: CudaGraphManager | None = None
        self.draft_graphs: DraftGraphManager | None = None
        self._graph_key: tuple[int, int, int] | None = None  # the graph the last step replayed
        pin = self.device.type == "cuda"
        self._host = [HostOutputs(self.max_num_reqs, self.num_spec + 1, pin) for _ in range(2)]
        self._slot = 0
        mtp_passes = self.num_spec if isinstance(self.proposer, MTPProposer) else 0
        self.dummy = DummyStep(self.step, mtp_passes) if self.lockstep else None

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self.step.kv_cache_config

    @property
    def kv_caches(self) -> KVCaches:
        if self.step.kv_caches is None:
            raise RuntimeError("the KV cache is not allocated yet")
        return self.step.kv_caches

    def graph_mode(self) -> str:
        """The CUDA-graph mode in force: FULL_DECODE_ONLY or NONE (validated here)."""
        mode = self.config.compilation.cudagraph_mode
        capable = self.device.type == "cuda" and self.step.supports_cuda_graphs
        if mode is None:
            return "FULL_DECODE_ONLY" if capable else "NONE"
        if mode != "NONE" and not capable:
            names = ", ".join(sorted({type(b).__name__ for b in self.step.backends.values()}))
            raise ValueError(
                f"cudagraph_mode {mode} needs a CUDA device and graph-capable attention "
                f"backends (device {self.device}, backends {names})"
            )
        return mode

    def warm_up(self) -> dict[str, float]:
        """Compile kernels and capture graphs before the engine reports ready
        (:func:`pdserve.runner.warmup.warm_up`); returns seconds per phase."""
        sizes = self.config.compilation.capture_sizes(self.max_num_reqs)
        # adaptive drafting verifies any j in 0..k: a graph for every 1 + j
        widths = range(1, self.num_spec + 2) if self.adaptive_drafts else (1, 1 + self.num_spec)
        query_lens = tuple(sorted(set(widths))) if self.num_spec else (1,)
        phases, self.graphs = warm_up(
            self.step,
            self.sampler,
            self.max_num_reqs,
            self.max_num_tokens,
            capture_sizes=sizes if self.graph_mode() == "FULL_DECODE_ONLY" else None,
            query_lens=query_lens,
        )
        if self.graphs is not None and isinstance(self.proposer, MTPProposer):
            self.draft_graphs = DraftGraphManager(self.proposer, self.graphs, self.num_spec)
            self.draft_graphs.capture_all()
            phases["capture_draft_graphs"] = self.draft_graphs.capture_seconds
        if self.adaptive_drafts and self.graphs is not None:
            t0 = time.perf_counter()
            self.step_costs = time_step_costs(self.graphs, self.draft_graphs, self.num_blocks)
            phases["time_step_costs"] = time.perf_counter() - t0
        return phases

    # -- KV cache --------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        spec = self.kv_cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_gpu_budget()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        # more blocks than every sequence at full length can use would only waste memory
        cap = self.max_num_reqs * self.max_blocks_per_req + 1
        n = min(spec.num_blocks_for(budget), cap)
        if n < 2:
            raise ValueError(
                f"not enough memory for the KV cache: budget {budget} bytes, "
                f"{spec.bytes_per_block} bytes per block"
            )
        return n

    def _profile_gpu_budget(self) -> int:
        """GPU bytes left for KV: ``gpu_memory_utilization`` of the card, less what this
        process holds after loading the weights and running a max-size forward (the
        caching allocator keeps the activation peak reserved). Other processes' memory is
        not charged to this instance, as in vLLM, but the KV cache must fit in what is free."""
        torch.cuda.synchronize(self.device)
        dummy_prompt_run(self.step, self.max_num_tokens, self.max_num_reqs)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget, ours = kv_budget_bytes(
            total,
            free,
            self._free_at_start,
            torch.cuda.memory_reserved(self.device),
            self.config.cache.gpu_memory_utilization,
        )
        logger.info(
            "GPU memory: total %.1f GiB, this process %.1f GiB, free %.1f GiB -> KV %.1f GiB",
            total / 2**30,
            ours / 2**30,
            free / 2**30,
            budget / 2**30,
        )
        torch.cuda.empty_cache()
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.step.kv_caches = KVCaches.allocate(self.kv_cache_config, num_blocks, self.device)

    # -- one step --------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        # sorted: tensor-parallel ranks decode these sets in their own hash order, and
        # freed rows must be taken in the same order on every rank
        for rid in sorted(so.finished_req_ids):
            self.batch.remove(rid)
        for rid in sorted(so.preempted_req_ids):
            self.batch.remove(rid)
        for new in so.scheduled_new_reqs:
            self.batch.add(new, self.device)
        for cached in so.scheduled_cached_reqs:
            self.batch.update(cached)

    def launch(self, so: SchedulerOutput, plan: StepPlan | None = None) -> StepHandle:
        """Enqueue the step's forward, sampling and drafting on the device and start
        copying the results to the host; returns without waiting for the device. The
        next step may be launched before this one is finished: what it needs from this
        one is read on the device (:meth:`StepPreparer.prepare`). ``plan``: the DP
        ranks' agreement for this step (``lockstep`` runners get one every step)."""
        return self.complete(self.launch_forward(so, plan))

    @torch.inference_mode()
    def launch_forward(
        self, so: SchedulerOutput, plan: StepPlan | None = None
    ) -> StepHandle | Forwarded:
        """:meth:`launch` up to the forward and prompt scoring; :meth:`complete` does the
        rest (after deferred structured-output masks are filled into ``so``)."""
        if self.lockstep and plan is None:
            raise RuntimeError("an expert-parallel runner needs the DP step plan every step")
        self._update_states(so)
        if so.is_empty:
            if plan is not None and plan.any_busy:
                return StepHandle(None, self._dummy_forward(plan))
            return StepHandle(None)
        inp = self.prep.prepare(so)
        hidden, logits, path = self._forward(inp, plan)
        pplan, scored = self._score_prompts(inp, hidden)
        return Forwarded(inp, hidden, logits, path, pplan, scored)

    @torch.inference_mode()
    def complete(self, fw: StepHandle | Forwarded, so: SchedulerOutput | None = None) -> StepHandle:
        """:meth:`launch` from sampling on (drafting, the copies to the host); ``so``
        brings masks filled after :meth:`launch_forward`."""
        if isinstance(fw, StepHandle):
            return fw
        inp = fw.inp
        if so is not None and so.masks_deferred:
            self.prep.apply_masks(inp, so)
        tokens, num, lp = self._sample(inp, fw.logits)
        top = self._top_logprobs(inp, fw.logits, tokens.shape[1])
        drafts = self._propose(inp, fw.hidden, tokens, num)
        flight = self.prep.record_launch(inp, tokens, num, drafts)
        n, width = len(inp.req_ids), tokens.shape[1]
        self._slot ^= 1
        host = self._host[self._slot]
        host.tokens[:n, :width].copy_(tokens, non_blocking=True)
        if num is not None:
            host.num[:n].copy_(num, non_blocking=True)
        if lp is not None:
            host.logprobs[:n, :width].copy_(lp, non_blocking=True)
        if drafts is not None:
            host.drafts[:n, : drafts.shape[1]].copy_(drafts, non_blocking=True)
        num_top = 0
        if top is not None:
            num_top = top[0].shape[2]
            host.top_ids[:n, :width, :num_top].copy_(top[0], non_blocking=True)
            host.top_lps[:n, :width, :num_top].copy_(top[1], non_blocking=True)
        if fw.scored is not None:
            host.prompt_host(self.max_num_tokens).copy_from(fw.scored)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepHandle(
            inp,
            fw.path,
            host,
            width,
            num is not None,
            lp is not None,
            drafts is not None,
            num_top,
            event,
            flight,
            fw.prompt_plan,
        )

    def finish(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return what it accepted (the step's one host sync)."""
        inp = handle.inp
        if inp is None:
            return RunnerOutput([], [], step_path=handle.path)
        host = handle.host
        assert host is not None
        if handle.done_event is not None:
            handle.done_event.synchronize()
        self.prep.landed(handle.flight)
        n, w = len(inp.req_ids), handle.width
        tokens = host.tokens[:n, :w].numpy()
        num = host.num[:n].numpy() if handle.has_num else np.ones(n, dtype=np.int64)
        self._record_sampled(inp, tokens, num)
        samples = inp.samples
        sampled = ragged(tokens, num if handle.has_num else None, samples)
        logprobs = None
        if handle.has_logprobs:
            lp = host.logprobs[:n, :w].numpy()
            logprobs = ragged(lp, num if handle.has_num else None, samples)
        drafts = None
        if handle.has_drafts:
            d = host.drafts[:n, : self.num_spec].numpy()
            drafts = [d[i].tolist() if samples[i] else [] for i in range(n)]
        out = RunnerOutput(inp.req_ids, sampled, logprobs, drafts, step_path=handle.path)
        if handle.num_top:
            k = handle.num_top
            per = num if handle.has_num else None
            out.top_token_ids = ragged(host.top_ids[:n, :w, :k].numpy(), per, samples)
            out.top_logprobs = ragged(host.top_lps[:n, :w, :k].numpy(), per, samples)
        if handle.prompt_plan is not None:
            out.prompt_logprobs = host.prompt_host(self.max_num_tokens).read(handle.prompt_plan)
        return out

    def _score_prompts(
        self, inp: StepInputs, hidden: torch.Tensor
    ) -> tuple[PromptLogprobsPlan | None, Scored | None]:
        """Score the prompt positions this step computes for the requests that asked for
        prompt logprobs (:mod:`pdserve.runner.prompt_logprobs`); (None, None) if none."""
        b = self.batch
        plan = plan_prompt_logprobs(
            inp.req_ids,
            inp.rows,
            inp.num_scheduled,
            b.num_computed,
            b.num_prompt_tokens,
            b.prompt_logprobs,
            b.token_ids,
            self.device,
        )
        if plan is None:
            return None, None
        rows = piece_rows(self.vocab_size)
        return plan, score_prompt_rows(hidden, plan, self.step.logits, rows)

    def _dummy_forward(self, plan: StepPlan) -> str:
        """An idle rank's forward for a step a peer computes (see ``dummy_step``)."""
        assert self.dummy is not None
        key = plan_graph_key(self.graphs, plan)
        self._graph_key = None
        if key is None:
            self.dummy.run_eager()
            return "dummy:eager"
        assert self.graphs is not None
        self.prep.wait_staging()  # fill_padding rewrites the pinned staging buffers
        self.dummy.run_graph(self.graphs, self.draft_graphs, key)
        self.prep.mark_staging_read()
        return "dummy:graph"

    def _forward(
        self, inp: StepInputs, plan: StepPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(hidden states of every scheduled token, logits of the sampled rows, path),
        from a graph replay or an eager forward.

        The path is "graph", or "eager:<why>": graphs_off, not_uniform_decode (a prompt,
        a chunk or a mixed batch; with a DP ``plan``: on any busy rank), no_graph_for_shape
        (more requests than the largest capture; with a plan: on the busiest rank)."""
        nreq, t = len(inp.req_ids), inp.num_tokens
        q = inp.uniform_query_len if plan is None else plan.uniform_q
        size = nreq if plan is None else plan.max_reqs
        self._graph_key = None
        if self.graphs is None:
            path = "eager:graphs_off"
        elif q is None or q not in self.graphs.query_lens:
            path = "eager:not_uniform_decode"  # prompts, chunks, mixed batches
        else:
            padded = self.graphs.padded_size(size, q)
            if padded is not None:
                width = self.graphs.width_for(inp.common.max_seq_len if plan is None else None)
                self._graph_key = (padded, q, width)
                self.buffers.fill_padding(nreq, t, padded, q)
                self.prep.mark_staging_read()
                hidden, logits = self.graphs.replay(padded, q, width)
                return hidden[:t], self._logit_rows(inp, logits), "graph"
            path = "eager:no_graph_for_shape"
        self.prep.mark_staging_read()
        hidden = self.step.hidden(inp.common)
        rows = hidden[: inp.num_logit_rows] if inp.logits_idx is None else hidden[inp.logits_idx]
        return hidden, self.step.logits(rows), path

    @staticmethod
    def _logit_rows(inp: StepInputs, logits: torch.Tensor) -> torch.Tensor:
        """The sampled rows of a graph's logits (one per padded token)."""
        if inp.logits_idx is None:
            return logits[: inp.num_logit_rows]
        return logits[inp.logits_idx]

    def _sample(
        self, inp: StepInputs, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens [B, w], accepted counts [B] or None when all are 1, logprobs [B, w])."""
        md = inp.sampling
        if inp.drafts is None:
            sampled, lp = self.sampler(logits, md)
            return sampled.unsqueeze(1), None, lp.unsqueeze(1) if lp is not None else None
        assert inp.row_start is not None and inp.num_rows is not None
        tokens, num = rejection_sample(
            self.sampler,
            logits,
            md,
            inp.drafts,
            inp.row_start,
            inp.num_rows,
            self.rejection_method,
            self.synthetic_rate,
        )
        lp = token_logprobs(logits, tokens, inp.row_start) if md.need_logprobs else None
        return tokens, num, lp

    def _top_logprobs(
        self, inp: StepInputs, logits: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, logprobs) [B, width, N] of each sampled position's top-N, when asked."""
        n = inp.sampling.num_top_logprobs
        if not n:
            return None
        if inp.drafts is None:
            ids, lps = top_logprobs(logits, n)
            return ids.unsqueeze(1), lps.unsqueeze(1)
        assert inp.row_start is not None
        ar = torch.arange(width, device=logits.device)
        rows = (inp.row_start[:, None] + ar[None, :]).clamp(max=logits.shape[0] - 1)
        ids, lps = top_logprobs(logits, n)
        return ids[rows], lps[rows]

    def _propose(
        self,
        inp: StepInputs,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        num: torch.Tensor | None,
    ) -> torch.Tensor | None:
        if self.proposer is None or not inp.propose:
            return None
        n = len(inp.req_ids)
        assert inp.first_token is not None
        counts = num if num is not None else torch.ones(n, dtype=torch.int64, device=self.device)
        dg = self.draft_graphs
        if dg is not None and self._graph_key in dg.graphs:
            assert inp.next_ids is not None and inp.sample_mask is not None
            key = self._graph_key
            return dg.run(key, tokens, counts, inp.first_token, inp.next_ids, inp.sample_mask)
        b = self.batch
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
            next_positions=self.buffers.positions.dev.index_select(0, inp.first_token) + counts,
            hidden=hidden,
            query_start_loc=inp.common.query_start_loc,
            input_ids=self.buffers.input_ids.dev[: inp.num_tokens],
            positions=self.buffers.positions.dev[: inp.num_tokens],
            common=inp.common,
            first_token=inp.first_token,
            num_rows=inp.num_rows,
            last_next_ids=inp.next_ids,
            block_tables=self.buffers.block_tables.dev[:n],
            sample_mask=inp.sample_mask,
        )
        return self.proposer.propose(batch)

    def _record_sampled(self, inp: StepInputs, tokens: np.ndarray, num: np.ndarray) -> None:
        """Append each sampling request's accepted tokens to its row (rows that changed
        hands since the step was prepared are left alone)."""
        b = self.batch
        ok = (b.row_gen[inp.rows] == inp.row_gens) & inp.samples
        rows, n = inp.rows[ok], num[ok]
        if not len(rows):
            return
        start = b.num_tokens[rows]
        if (n == 1).all():  # one token each (no drafts, or all rejected)
            keep1 = start < self.max_model_len
            b.token_ids[rows[keep1], start[keep1]] = tokens[ok][keep1, 0]
            b.num_tokens[rows] = np.minimum(start + 1, self.max_model_len)
            return
        which = np.repeat(np.arange(len(rows)), n)
        off = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        pos = start[which] + off
        keep = pos < self.max_model_len
        b.token_ids[rows[which][keep], pos[keep]] = tokens[ok][which, off][keep]
        b.num_tokens[rows] = np.minimum(start + n, self.max_model_len)
