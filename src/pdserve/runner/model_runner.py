"""The model runner: turns a ``SchedulerOutput`` into one forward pass and sampled tokens.

Three layers of batch state: the scheduler's requests (CPU objects), the runner's
``InputBatch`` rows (numpy), and this step's device tensors, written into static
buffers (so later CUDA graphs can replay over them). Batch prep is numpy over rows;
the only host sync per step is reading the sampled token ids back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache.manager import cdiv
from pdserve.engine.kv_cache.spec import KVCacheGroupSpec, KVCacheSpec
from pdserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.layers.attention import AttentionBackend, CommonAttentionMetadata, get_attn_backend
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.forward_context import set_forward_context
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.sampler import Sampler, SamplingMetadata
from pdserve.runner.warmup import dummy_prompt_run, warm_up

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
CPU_DEFAULT_KV_BYTES = 256 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but no CUDA GPU is available")
    return dev


@dataclass
class _StepInputs:
    req_ids: list[str]
    rows: np.ndarray
    num_scheduled: np.ndarray
    uniform_query_len: int | None  # q when every request computes exactly q tokens
    num_tokens: int
    logits_indices: torch.Tensor
    attn_metadata: CommonAttentionMetadata
    sampling: SamplingMetadata
    done: np.ndarray  # per request: tokens computed once this step has run
    row_gens: np.ndarray  # the rows' generations when the step was prepared


@dataclass
class StepHandle:
    """A launched step: its inputs, and its sampled ids on their way to the host."""

    inp: _StepInputs | None  # None for an empty step
    path: str = "eager"
    h_sampled: torch.Tensor | None = None  # host copy (pinned on CUDA), filled when done
    h_logprobs: torch.Tensor | None = None
    done_event: torch.cuda.Event | None = None


# What this process may hold on the GPU outside torch's caching allocator after start-up
# (cuBLAS handles, loaded Triton modules, graph executables): the CUDA context itself is
# already there when the start-up free memory is read.
NON_TORCH_ALLOWANCE = 1 << 30


def kv_budget_bytes(
    total: int, free: int, free_at_start: int, reserved: int, utilization: float
) -> tuple[int, int]:
    """(KV cache bytes, this process's bytes) for ``gpu_memory_utilization``.

    This process's share is the drop in free memory since start-up, capped by what its
    allocator reserved plus :data:`NON_TORCH_ALLOWANCE`: instances sharing a GPU start
    together, and the drop alone would charge a neighbour's weights loaded meanwhile to
    this one (a prefill instance once got 3.5 GiB of KV instead of 40 for that reason).
    The KV cache must also fit in what is free now, less 2% slack for graphs, the
    sampler and allocator rounding.
    """
    ours = min(free_at_start - free, reserved + NON_TORCH_ALLOWANCE)
    budget = int(total * utilization) - ours
    headroom = int(0.02 * total)
    return min(budget, free - headroom), ours


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from pdserve.models.loader import load_model

        self.config = config
        self.device = resolve_device(config.device.device)
        self._free_at_start = 0
        if self.device.type == "cuda":
            torch.cuda.init()
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self.model, self.hf_config = load_model(config.model.model, config.model.dtype, self.device)
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
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
        self.backend = self._make_backend(config.device.attention_backend)
        self.sampler = Sampler(self.device, config.model.seed)
        self.batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_blocks_per_req, self.vocab_size
        )
        self._alloc_static_buffers()
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.graphs: CudaGraphManager | None = None
        self.kv_connector: KVConnectorWorker | None = None
        # async scheduling: the last launched step's sampled ids stay on the device and
        # feed the next step's inputs; row -> index into them (-1: that row sampled none)
        self._prev_sampled: torch.Tensor | None = None
        self._prev_index = np.full(self.max_num_reqs, -1, dtype=np.int64)
        # set once a step's host->device copies are enqueued; the next step waits on it
        # before it rewrites the pinned staging buffers those copies read
        self._staging_free: torch.cuda.Event | None = None

    def _make_backend(self, name: str) -> AttentionBackend:
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if name == "triton":
            from pdserve.layers.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(max_model_len=self.max_model_len)
        return get_attn_backend(name)

    def graph_mode(self) -> str:
        """The CUDA-graph mode in force: FULL_DECODE_ONLY or NONE (validated here)."""
        mode = self.config.compilation.cudagraph_mode
        capable = self.device.type == "cuda" and self.backend.supports_cuda_graphs
        if mode is None:
            return "FULL_DECODE_ONLY" if capable else "NONE"
        if mode != "NONE" and not capable:
            raise ValueError(
                f"cudagraph_mode {mode} needs a CUDA device and a graph-capable attention backend "
                f"(device {self.device}, backend {self.backend.name})"
            )
        return mode

    def warm_up(self) -> dict[str, float]:
        """Compile kernels and capture graphs before the engine reports ready
        (:func:`pdserve.runner.warmup.warm_up`); returns seconds per phase."""
        return warm_up(self)

    # -- buffers and KV cache --------------------------------------------------------------
    def _alloc_static_buffers(self) -> None:
        pin = self.device.type == "cuda"
        t, r = self.max_num_tokens, self.max_num_reqs

        def host(n: int | tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dt, pin_memory=pin)

        def dev(n: int | tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dt, device=self.device)

        self.h_input_ids, self.d_input_ids = host(t, torch.int64), dev(t, torch.int64)
        self.h_positions, self.d_positions = host(t, torch.int64), dev(t, torch.int64)
        self.h_slots, self.d_slots = host(t, torch.int64), dev(t, torch.int64)
        self.h_req_idx, self.d_req_idx = host(t, torch.int64), dev(t, torch.int64)
        self.h_q_idx, self.d_q_idx = host(t, torch.int64), dev(t, torch.int64)
        self.h_qsl, self.d_qsl = host(r + 1, torch.int32), dev(r + 1, torch.int32)
        self.h_seq_lens, self.d_seq_lens = host(r, torch.int32), dev(r, torch.int32)
        self.h_logits_idx, self.d_logits_idx = host(r, torch.int64), dev(r, torch.int64)
        shape = (r, self.max_blocks_per_req)
        self.h_block_tables, self.d_block_tables = host(shape, torch.int32), dev(shape, torch.int32)
        self.h_patch_dst, self.d_patch_dst = host(r, torch.int64), dev(r, torch.int64)
        self.h_patch_src, self.d_patch_src = host(r, torch.int64), dev(r, torch.int64)
        # two slots: a step's sampled ids land in one while the next step's use the other
        self.h_sampled = [host(r, torch.int64) for _ in range(2)]
        self.h_logprobs = [host(r, torch.float32) for _ in range(2)]
        self._slot = 0

    def kv_cache_spec(self) -> KVCacheSpec:
        hc = self.hf_config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = 2 * int(hc.num_key_value_heads) * int(hc.head_dim) * elt
        layers = tuple(range(int(hc.num_hidden_layers)))
        return KVCacheSpec(self.block_size, (KVCacheGroupSpec("attn", layers, per_layer),))

    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        spec = self.kv_cache_spec()
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
        dummy_prompt_run(self, self.max_num_tokens)
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

    def _num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def _kv_heads_dim(self) -> tuple[int, int]:
        return int(self.hf_config.num_key_value_heads), int(self.hf_config.head_dim)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, *self._kv_heads_dim())
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self._num_layers())
        ]

    # -- one step --------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.remove(rid)
        for rid in so.preempted_req_ids:
            self.batch.remove(rid)
        for new in so.scheduled_new_reqs:
            self.batch.add(new, self.device)
        for cached in so.scheduled_cached_reqs:
            self.batch.update(cached)

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        b = self.batch
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous step's uploads have been read
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

        self.h_input_ids.numpy()[:t] = b.token_ids[tok_rows, pos]
        self.h_positions.numpy()[:t] = pos
        bs = self.block_size
        self.h_slots.numpy()[:t] = (
            b.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        )
        self.h_req_idx.numpy()[:t] = req_idx
        self.h_q_idx.numpy()[:t] = q_idx
        self.h_qsl.numpy()[: nreq + 1] = cu
        self.h_seq_lens.numpy()[:nreq] = seq_lens
        self.h_logits_idx.numpy()[:nreq] = cu[1:] - 1
        max_seq = int(seq_lens.max())
        nblk = cdiv(max_seq, bs)
        self.h_block_tables.numpy()[:nreq, :nblk] = b.block_table[rows, :nblk]

        def up(h: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
            d[:n].copy_(h[:n], non_blocking=True)
            return d[:n]

        md = CommonAttentionMetadata(
            num_reqs=nreq,
            num_actual_tokens=t,
            max_query_len=int(nsched.max()),
            max_seq_len=max_seq,
            block_size=bs,
            query_start_loc=up(self.h_qsl, self.d_qsl, nreq + 1),
            seq_lens=up(self.h_seq_lens, self.d_seq_lens, nreq),
            block_tables=self._upload_block_tables(nreq, nblk),
            slot_mapping=up(self.h_slots, self.d_slots, t),
            token_req_idx=up(self.h_req_idx, self.d_req_idx, t),
            token_q_idx=up(self.h_q_idx, self.d_q_idx, t),
        )
        up(self.h_input_ids, self.d_input_ids, t)
        self._patch_pending_inputs(tok_rows, pos, t)
        up(self.h_positions, self.d_positions, t)
        logits_idx = up(self.h_logits_idx, self.d_logits_idx, nreq)
        uniform = int(nsched[0]) if bool((nsched == nsched[0]).all()) else None
        return _StepInputs(
            req_ids,
            rows,
            nsched,
            uniform,
            t,
            logits_idx,
            md,
            self._sampling_metadata(rows, nsched),
            seq_lens,
            b.row_gen[rows].copy(),
        )

    def _patch_pending_inputs(self, tok_rows: np.ndarray, pos: np.ndarray, t: int) -> None:
        """Input tokens not known on the host yet (sampled by the step still in flight,
        under async scheduling) are taken from that step's sampled ids on the device."""
        pending = pos >= self.batch.num_tokens[tok_rows]
        if not pending.any():
            return
        dst = np.flatnonzero(pending)
        src = self._prev_index[tok_rows[dst]]
        if self._prev_sampled is None or (src < 0).any():
            raise RuntimeError("a step needs a token that no step in flight samples")
        n = len(dst)
        self.h_patch_dst.numpy()[:n] = dst
        self.h_patch_src.numpy()[:n] = src
        d_dst = self.d_patch_dst[:n]
        d_src = self.d_patch_src[:n]
        d_dst.copy_(self.h_patch_dst[:n], non_blocking=True)
        d_src.copy_(self.h_patch_src[:n], non_blocking=True)
        self.d_input_ids.index_copy_(0, d_dst, self._prev_sampled.index_select(0, d_src))

    def _upload_block_tables(self, nreq: int, nblk: int) -> torch.Tensor:
        d = self.d_block_tables[:nreq, :nblk]
        d.copy_(self.h_block_tables[:nreq, :nblk], non_blocking=True)
        return d

    def _sampling_metadata(self, rows: np.ndarray, nsched: np.ndarray) -> SamplingMetadata:
        b = self.batch
        params = [b.params[r] for r in rows]
        greedy = np.fromiter(
            (p is not None and p.greedy for p in params), dtype=bool, count=len(rows)
        )
        dev = self.device

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)

        all_greedy = bool(greedy.all())
        temperature = top_k = top_p = min_p = greedy_rows = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = tensor(b.temperature[rows])
            greedy_rows = tensor(greedy) if greedy.any() else None
            tk = b.top_k[rows]
            if (tk > 0).any():
                top_k = tensor(np.where(tk > 0, tk, self.vocab_size))
            tp = b.top_p[rows]
            if (tp < 1.0).any():
                top_p = tensor(tp)
            mp = b.min_p[rows]
            if (mp > 0.0).any():
                min_p = tensor(mp)
            for i, r in enumerate(rows):
                gen = b.generators.get(int(r))
                if gen is not None:
                    generators[i] = gen
        # min_tokens: ban EOS / stop ids until enough tokens were produced
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (r, p) in enumerate(zip(rows, params, strict=True)):
            if p is not None and p.min_tokens and b.banned_ids[r]:
                # outputs before this step's sample, counting one still in flight
                done = max(b.num_tokens[r], b.num_computed[r] + nsched[i]) - b.num_prompt_tokens[r]
                if done < p.min_tokens:
                    ban_rows.extend([i] * len(b.banned_ids[r]))
                    ban_ids.extend(b.banned_ids[r])
        banned = None
        if ban_rows:
            banned = (
                torch.tensor(ban_rows, dtype=torch.int64, device=dev),
                torch.tensor(ban_ids, dtype=torch.int64, device=dev),
            )
        need_lp = any(p is not None and p.logprobs is not None for p in params)
        return SamplingMetadata(
            all_greedy, temperature, greedy_rows, top_k, top_p, min_p, generators, banned, need_lp
        )

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run one step to the end: :meth:`launch` then :meth:`finish`."""
        return self.finish(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Enqueue the step's forward and sampling on the device and start copying the
        sampled ids to the host; returns without waiting for the device. The next
        step may be launched before this one is finished: tokens it needs that this
        one samples are read from the device (:meth:`_patch_pending_inputs`)."""
        self._update_states(so)
        if self.kv_connector is not None and so.kv_connector_metadata is not None:
            self.kv_connector.start_load_kv(so.kv_connector_metadata)
        if so.is_empty:
            return StepHandle(None)
        inp = self._prepare_inputs(so)
        logits, path = self._forward(inp)
        sampled, lp = self.sampler(logits, inp.sampling)
        n = len(inp.req_ids)
        self._prev_sampled = sampled
        self._prev_index.fill(-1)
        self._prev_index[inp.rows] = np.where(
            np.fromiter((r in so.sampling_req_ids for r in inp.req_ids), bool, count=n),
            np.arange(n),
            -1,
        )
        self._slot ^= 1
        h_sampled = self.h_sampled[self._slot][:n]
        h_sampled.copy_(sampled, non_blocking=True)
        h_lp = None
        if lp is not None:
            h_lp = self.h_logprobs[self._slot][:n]
            h_lp.copy_(lp, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepHandle(inp, path, h_sampled, h_lp, event)

    def finish(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step and return what it sampled (the step's one host sync)."""
        inp = handle.inp
        if inp is None:
            out = RunnerOutput([], [])
        else:
            assert handle.h_sampled is not None
            if handle.done_event is not None:
                handle.done_event.synchronize()
            sampled_ids = handle.h_sampled.tolist()
            logprobs = handle.h_logprobs.tolist() if handle.h_logprobs is not None else None
            self._record_sampled(inp, sampled_ids)
            out = RunnerOutput(inp.req_ids, sampled_ids, logprobs, step_path=handle.path)
        if self.kv_connector is not None:
            out.kv_connector_output = self.kv_connector.get_finished()
        return out

    def _mark_staging_read(self) -> None:
        """Called once the step's last host->device copy is enqueued."""
        if self.device.type == "cuda":
            if self._staging_free is None:
                self._staging_free = torch.cuda.Event()
            self._staging_free.record()

    def _forward(self, inp: _StepInputs) -> tuple[torch.Tensor, str]:
        """Logits of each request's last token, from a graph replay or an eager forward.

        The path is "graph", or "eager:<why>": graphs_off, not_uniform_decode (a prompt,
        a chunk or a mixed batch), no_graph_for_shape (more requests than the largest
        capture)."""
        nreq = len(inp.req_ids)
        if self.graphs is None:
            path = "eager:graphs_off"
        elif inp.uniform_query_len not in self.graphs.query_lens:
            path = "eager:not_uniform_decode"  # prompts, chunks, mixed batches
        else:
            assert inp.uniform_query_len is not None
            q = inp.uniform_query_len
            padded = self.graphs.padded_size(nreq, q)
            if padded is not None:
                self.graphs.fill_padding(nreq, inp.num_tokens, padded, q)
                self._mark_staging_read()
                return self.graphs.replay(padded, q)[:nreq], "graph"
            path = "eager:no_graph_for_shape"
        self._mark_staging_read()
        t = inp.num_tokens
        md = self.backend.build_metadata(inp.attn_metadata)
        with set_forward_context(self.backend, md, self.kv_caches):
            hidden = self.model(self.d_input_ids[:t], self.d_positions[:t])
        return self.model.compute_logits(hidden[inp.logits_indices]), path

    def _record_sampled(self, inp: _StepInputs, sampled: list[int]) -> None:
        """Advance each row; append the sampled token where the request reached its end
        (a prompt chunk that stops short samples nothing)."""
        b = self.batch
        ok = b.row_gen[inp.rows] == inp.row_gens  # rows still held by the same requests
        rows, done = inp.rows[ok], inp.done[ok]
        b.num_computed[rows] = np.maximum(b.num_computed[rows], done)
        m = (done >= b.num_tokens[rows]) & (done < self.max_model_len)
        b.token_ids[rows[m], done[m]] = np.asarray(sampled, dtype=np.int32)[ok][m]
        b.num_tokens[rows[m]] = done[m] + 1
