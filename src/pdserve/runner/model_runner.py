"""The model runner: turns a ``SchedulerOutput`` into one forward pass and accepted tokens.

Batch state in four places: the scheduler's requests (CPU objects), the runner's
``InputBatch`` rows (numpy: the row map and the host's counts), the request state on
the device (:mod:`pdserve.runner.request_state`: what each step leaves for the next),
and this step's device tensors, written into the static
:class:`~pdserve.runner.input_buffers.InputBuffers` (so CUDA graphs replay over them).
A step runs through the phases of :mod:`pdserve.runner.step_pipeline`; the only host
sync per step is reading the accepted tokens back.

A step computes ``num_scheduled_tokens`` per request; requests that reach their end
sample. With a proposer (speculative decoding) the last ``num_drafts`` of a request's
tokens are drafts: the logits of the last ``num_drafts + 1`` positions go through the
rejection sampler, which accepts a prefix of the drafts plus one token, and the
proposer drafts the next step's tokens from what was accepted, on the device.

Data parallelism: each DP rank has its own runner on its own device (``groups``). Under
expert parallelism (``lockstep``) every step's launch gets the step's
:class:`~pdserve.distributed.dp_sync.StepPlan`: the graph decision follows the plan (all
ranks replay the same graph or all run eagerly), and a rank with nothing scheduled runs
a dummy forward (:mod:`pdserve.runner.dummy_step`) whenever a peer runs a real one.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.config import EngineConfig
from pdserve.core_types.cache_spec import KVCacheConfig
from pdserve.core_types.scheduler_output import SchedulerOutput
from pdserve.core_types.utils import cdiv
from pdserve.distributed.groups import ParallelGroups
from pdserve.forward_context import KVCaches
from pdserve.layers.moe import MoE
from pdserve.layers.sampler import Sampler
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.draft_graph import DraftGraphManager
from pdserve.runner.dummy_step import DummyStep
from pdserve.runner.graph_costs import time_step_costs
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers
from pdserve.runner.memory import (
    CPU_DEFAULT_KV_BYTES,
    kv_budget_bytes,
    resolve_device,
)
from pdserve.runner.model_step import ModelStep, collect_cache_layers
from pdserve.runner.request_state import RequestState
from pdserve.runner.step_inputs import StepPreparer
from pdserve.runner.warmup import dummy_prompt_run, warm_up
from pdserve.spec_decode.build import build_proposer
from pdserve.spec_decode.mtp import MTPProposer
from pdserve.spec_decode.proposer import Proposer

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
        # imported here, not with the module: a kernel module's @triton.jit functions are
        # decorated on import, which must come after TRITON_INTERPRET is set (tests/kernels)
        from pdserve.kernels._utils import use_pdl_by_default
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
        # before anything is compiled or captured (ModelStep.hidden sets it for each step)
        use_pdl_by_default(self.model.pdl_tokens != 0)
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
        self.state = RequestState(
            self.max_num_reqs, self.num_spec, self.device, drafting=self.proposer is not None
        )
        self.prep = StepPreparer(
            self.batch, self.buffers, self.state, self.device, self.vocab_size, self.lookahead
        )
        self.num_blocks = 0
        self.graphs: CudaGraphManager | None = None
        self.draft_graphs: DraftGraphManager | None = None
        self._graph_key: tuple[int, int, int] | None = None  # the graph the last step replayed
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
        self.state.warm_up(self.buffers)
        if self.graphs is not None and isinstance(self.proposer, MTPProposer):
            self.draft_graphs = DraftGraphManager(
                self.proposer, self.graphs, self.num_spec, self.adaptive_drafts
            )
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

    # -- one step (:mod:`pdserve.runner.step_pipeline`) ----------------------------------
    def update_rows(self, so: SchedulerOutput, step: int) -> None:
        """Drop finished and preempted requests' rows, add new ones, update the rest."""
        # sorted: tensor-parallel ranks decode these sets in their own hash order, and
        # freed rows must be taken in the same order on every rank
        for rid in sorted(so.finished_req_ids):
            self.batch.remove(rid)
        for rid in sorted(so.preempted_req_ids):
            self.batch.remove(rid)
        for new in so.scheduled_new_reqs:
            self.batch.add(new, self.device, step)
        for cached in so.scheduled_cached_reqs:
            self.batch.update(cached)
