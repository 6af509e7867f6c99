"""Start-up work of the model runner: dummy forwards and samples that compile every
kernel traffic can reach, then CUDA-graph capture, all before the engine reports ready.

Kernels and library heuristics are specialised per shape and per variant, so the first
request would otherwise pay for compiling whatever path it takes first.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_cache.manager import cdiv
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.forward_context import set_forward_context
from pdserve.runner.sampler import SamplingMetadata

if TYPE_CHECKING:
    from pdserve.runner.model_runner import ModelRunner

# Query lengths of the mixed batches :func:`dummy_paged_runs` runs: each pairs a chunk
# with a one-token request, one batch per tile size of the paged prefill kernel.
PAGED_WARMUP_QUERY_LENS = (4, 8, 16, 64)


def warm_up(r: ModelRunner) -> dict[str, float]:
    """Compile kernels and capture graphs. Returns seconds spent per phase (printed at
    start-up)."""
    phases: dict[str, float] = {}
    if r.device.type == "cuda":
        t0 = time.perf_counter()
        dummy_gemms(r)
        torch.cuda.synchronize(r.device)
        phases["gemm_sweep"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # eager prefill path at 16, 64, 256, ... tokens and the full budget: kernels and
    # library heuristics are specialised per shape, and the first request must not pay
    n = 16
    while n < r.max_num_tokens:
        dummy_prompt_run(r, n)
        n *= 4
    dummy_prompt_run(r, r.max_num_tokens)
    dummy_paged_runs(r)
    dummy_uniform_runs(r)
    dummy_samples(r)
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    phases["compile_eager"] = time.perf_counter() - t0
    if r.graph_mode() == "FULL_DECODE_ONLY":
        sizes = r.config.compilation.capture_sizes(r.max_num_reqs)
        r.graphs = CudaGraphManager(r, sizes)
        r.graphs.capture_all()
        phases["capture_graphs"] = r.graphs.capture_seconds
    return phases


def gemm_warmup_token_counts(max_tokens: int) -> list[int]:
    """Token counts :func:`dummy_gemms` runs: every count up to 128, every 8th up to
    1024, every 32nd beyond, and ``max_tokens`` itself."""
    counts = [*range(1, 129), *range(136, 1025, 8), *range(1056, max_tokens, 32), max_tokens]
    return sorted({m for m in counts if m <= max_tokens})


def dummy_gemms(r: ModelRunner) -> None:
    """Every linear layer's GEMM shape at many token counts (the LM head's at up to
    ``max_num_reqs`` rows, what it computes logits for).

    cuBLAS picks a kernel per (M, N, K), and the first launch of a kernel it has not run
    yet costs about 3 ms per layer GEMM on an H200 (measured: run 19, 2-5 ms at new
    token counts; 0.2-0.6 ms after this sweep): without it the first prompts after
    start-up paid that once per new kernel, in every layer shape. One module per
    distinct shape is enough; the inputs are uninitialised and the outputs dropped."""
    from pdserve.layers.embedding import LMHead
    from pdserve.layers.linear import Linear

    shapes: dict[tuple, Linear | LMHead] = {}
    for mod in r.model.modules():
        if isinstance(mod, (Linear, LMHead)):
            key = (type(mod), tuple(mod.weight.shape), getattr(mod, "bias", None) is not None)
            shapes.setdefault(key, mod)
    with torch.inference_mode():
        for m in gemm_warmup_token_counts(r.max_num_tokens):
            for mod in shapes.values():
                if isinstance(mod, LMHead) and m > r.max_num_reqs:
                    continue
                k = int(mod.weight.shape[1])
                mod(torch.empty(m, k, dtype=r.dtype, device=r.device))


def _forward(
    r: ModelRunner, md: CommonAttentionMetadata, caches: list[torch.Tensor], num_logits: int
) -> None:
    t = md.num_actual_tokens
    with torch.inference_mode(), set_forward_context(r.backend, md, caches):
        hidden = r.model(r.d_input_ids[:t], r.d_positions[:t])
        r.model.compute_logits(hidden[-num_logits:])


def dummy_prompt_run(r: ModelRunner, num_tokens: int) -> None:
    """A forward over ``num_tokens`` tokens of one request, on a throwaway one-block cache
    (also the activation peak the GPU memory profile measures)."""
    n = min(num_tokens, r.max_model_len)
    dev = r.device
    shape = r.backend.kv_cache_shape(1, n, *r._kv_heads_dim())
    caches = [torch.zeros(shape, dtype=r.dtype, device=dev) for _ in range(r._num_layers())]
    md = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        block_size=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=dev),
        slot_mapping=torch.arange(n, device=dev),
        token_req_idx=torch.zeros(n, dtype=torch.int64, device=dev),
        token_q_idx=torch.arange(n, device=dev),
    )
    _forward(r, md, caches, r.max_num_reqs)


def _null_block_table(r: ModelRunner, num_reqs: int, num_blocks: int) -> torch.Tensor:
    """Block-table rows pointing at the null block, as a view of the runner's own device
    buffer: Triton specialises a kernel on its integer arguments (a row stride divisible
    by 16 or not), so a dummy table must have the row stride traffic will have."""
    bt = r.d_block_tables[:num_reqs, :num_blocks]
    bt.zero_()
    return bt


def _null_block_forward(r: ModelRunner, q_lens: list[int]) -> None:
    """A forward of requests with ``q_lens`` new tokens, each after one cached block,
    through the real KV cache but reading and writing only the null block."""
    dev, bs = r.device, r.block_size
    seq_lens = [q + bs for q in q_lens]
    t = sum(q_lens)
    n = len(q_lens)
    md = CommonAttentionMetadata(
        num_reqs=n,
        num_actual_tokens=t,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        query_start_loc=torch.tensor(
            [0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=_null_block_table(r, n, cdiv(max(seq_lens), bs)),
        slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),
        token_req_idx=torch.tensor([i for i, q in enumerate(q_lens) for _ in range(q)], device=dev),
        token_q_idx=torch.tensor([j for q in q_lens for j in range(q)], device=dev),
    )
    _forward(r, md, r.kv_caches, n)


def dummy_paged_runs(r: ModelRunner) -> None:
    """Mixed batches (a chunk with a cached prefix next to a decode token) on the null
    block: they compile the paged prefill kernel, which the single-prompt dummies never
    reach (those take the SDPA path), for each of its tile sizes. Without this, the first
    chunked prompt or mixed step after start-up paid the kernel's compilation (about
    1.5 s on an H200)."""
    if not r.kv_caches:
        return
    for q in PAGED_WARMUP_QUERY_LENS:
        q_lens = [min(q, r.max_num_tokens - 1), 1]
        if max(q_lens) + r.block_size <= r.max_model_len:
            _null_block_forward(r, q_lens)


def dummy_uniform_runs(r: ModelRunner) -> None:
    """One request of ``q`` new tokens after a cached block, for every ``q`` up to
    ``MAX_UNIFORM_QUERY_LEN``, on the null block: a batch in which every request has the
    same short query (a short prompt, or a speculative verify) goes to the decode kernel,
    whose tile config depends on ``q``. Without this the first 8-token prompt after
    start-up paid a compile (0.88 s on an H200)."""
    if not r.kv_caches or r.backend.name != "triton":
        return
    from pdserve.layers.attention.triton_backend import MAX_UNIFORM_QUERY_LEN

    for q in range(1, min(MAX_UNIFORM_QUERY_LEN, r.max_num_tokens) + 1):
        if q + r.block_size <= r.max_model_len:
            _null_block_forward(r, [q])


def dummy_samples(r: ModelRunner) -> None:
    """Run every sampler variant once (greedy; random with each combination of a greedy
    row, top-k, top-p and min-p: the Triton kernel compiles one variant per combination)
    so none is compiled under traffic."""
    n, dev = 2, r.device
    logits = torch.randn(n, r.vocab_size, device=dev)
    t = torch.ones(n, device=dev)
    greedy = SamplingMetadata(
        all_greedy=True,
        temperature=None,
        greedy_rows=None,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        banned=None,
        need_logprobs=True,
    )
    r.sampler(logits, greedy)
    for has_greedy, has_k, has_p, has_min_p in itertools.product((False, True), repeat=4):
        md = SamplingMetadata(
            all_greedy=False,
            temperature=t,
            greedy_rows=torch.tensor([True, False], device=dev) if has_greedy else None,
            top_k=torch.full((n,), 5, dtype=torch.int64, device=dev) if has_k else None,
            top_p=t * 0.9 if has_p else None,
            min_p=t * 0.01 if has_min_p else None,
            generators={},
            banned=None,
            need_logprobs=False,
        )
        r.sampler(logits, md)
