"""Start-up work of the model runner: dummy forwards and samples that compile every
kernel traffic can reach, then CUDA-graph capture, all before the engine reports ready.

Kernels and library heuristics are specialised per shape and per variant, so the first
request would otherwise pay for compiling whatever path it takes first. Every function
here takes the :class:`~pdserve.runner.model_step.ModelStep` (model, input buffers,
backends, caches) and nothing of the runner's request state.
"""

from __future__ import annotations

import itertools
import time

import torch

from pdserve.core_types.utils import cdiv
from pdserve.forward_context import KVCaches
from pdserve.layers.attention import CommonAttentionMetadata
from pdserve.layers.sampler import Sampler, SamplingMetadata
from pdserve.runner.cuda_graph import CudaGraphManager
from pdserve.runner.model_step import ModelStep

# Query lengths of the mixed batches :func:`dummy_paged_runs` runs: each pairs a chunk
# with a one-token request, one batch per tile size of the paged prefill kernel.
PAGED_WARMUP_QUERY_LENS = (4, 8, 16, 64)
CPU_WARMUP_TOKENS = 256  # the largest dummy forward of a CPU warm-up


def warm_up(
    step: ModelStep,
    sampler: Sampler,
    max_num_reqs: int,
    max_num_tokens: int,
    capture_sizes: list[int] | None,
    query_lens: tuple[int, ...] = (1,),
) -> tuple[dict[str, float], CudaGraphManager | None]:
    """Compile kernels, then capture graphs of ``capture_sizes`` x ``query_lens`` (None:
    no graphs). Returns seconds spent per phase (printed at start-up) and the graphs."""
    phases: dict[str, float] = {}
    cuda = step.device.type == "cuda"
    if cuda:
        t0 = time.perf_counter()
        max_logit_rows = min(max_num_tokens, max_num_reqs * max(query_lens))
        dummy_gemms(step, max_logit_rows, max_num_tokens)
        torch.cuda.synchronize(step.device)
        phases["gemm_sweep"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the eager prefill path (prompt_warmup_lens); on the CPU nothing is compiled, so a
    # few hundred tokens only check that the paths run
    top = max_num_tokens if cuda else min(max_num_tokens, CPU_WARMUP_TOKENS)
    for n in prompt_warmup_lens(top, cuda):
        dummy_prompt_run(step, n, max_num_reqs)
    if cuda:
        sdpa_plans(step, top)
    dummy_paged_runs(step, top)
    dummy_uniform_runs(step, top)
    dummy_samples(sampler, step.vocab_size, step.device)
    if cuda:
        torch.cuda.synchronize(step.device)
    phases["compile_eager"] = time.perf_counter() - t0
    graphs = None
    if capture_sizes is not None:
        graphs = CudaGraphManager(step, capture_sizes, query_lens)
        graphs.capture_all()
        phases["capture_graphs"] = graphs.capture_seconds
    return phases, graphs


def prompt_warmup_lens(top: int, every_size: bool) -> list[int]:
    """Token counts of the single-prompt dummy forwards, up to ``top``.

    ``every_size`` (a GPU, where kernels compile): each power of two from 16 below
    ``top`` and the odd count one below it, then ``top - 1`` and ``top``. Kernels size
    tiles by the next power of two of a token count or score width (the indexer's
    select, the MoE token alignment, the split reduces) and Triton specialises their
    integer arguments on divisibility by 16, so every (power of two, odd or even) a
    prompt can reach is compiled here. With every other power of two, glm5-m12-e64's
    first pass of offline traffic compiled six kernels (RESULTS.md run 139; which
    variants they were, fp8_bench's ``first_pass_variants`` records). Else (a CPU) 16,
    64, 256, ... and ``top``."""
    lens: list[int] = []
    n = 16
    while n < top:
        lens += [n - 1, n] if every_size else [n]
        n *= 2 if every_size else 4
    lens += [top - 1, top] if every_size else [top]
    return sorted({m for m in lens if m >= 1})


def gemm_warmup_token_counts(max_tokens: int) -> list[int]:
    """Token counts :func:`dummy_gemms` runs: every count up to 128, every 8th up to
    1024, every 32nd beyond, and ``max_tokens`` itself."""
    counts = [*range(1, 129), *range(136, 1025, 8), *range(1056, max_tokens, 32), max_tokens]
    return sorted({m for m in counts if m <= max_tokens})


def sdpa_plans(step: ModelStep, max_tokens: int) -> None:
    """cuDNN's prompt-attention plans for every length bucket up to ``max_tokens``, where
    ``PDSERVE_SDPA_PREFILL`` picks a cuDNN kernel (its first call at a new shape builds
    a plan: tens of milliseconds the first prompt of each length would pay)."""
    from pdserve.kernels.prefill_attention import warm_sdpa_plans
    from pdserve.layers.attention.layer import Attention

    shapes = {
        (m.num_heads, m.num_kv_heads, m.head_dim)
        for m in step.model.modules()
        if isinstance(m, Attention)
    }
    warm_sdpa_plans(shapes, max_tokens, step.dtype, step.device)


def dummy_gemms(step: ModelStep, max_logit_rows: int, max_num_tokens: int) -> None:
    """Every linear layer's GEMM shape at many token counts (the LM head's at up to
    ``max_logit_rows`` rows, what it computes logits for).

    cuBLAS picks a kernel per (M, N, K), and the first launch of a kernel it has not run
    yet costs milliseconds per layer GEMM (``benchmarks/RESULTS.md``, session 4):
    without this sweep the first prompts after start-up paid that once per
    new kernel, in every layer shape. One module per distinct shape is enough; the
    inputs are uninitialised and the outputs dropped."""
    from pdserve.layers.embedding import LMHead
    from pdserve.layers.linear import Linear

    shapes: dict[tuple, Linear | LMHead] = {}
    for mod in step.model.modules():
        if isinstance(mod, (Linear, LMHead)):
            key = (type(mod), tuple(mod.weight.shape), getattr(mod, "bias", None) is not None)
            shapes.setdefault(key, mod)
    with torch.inference_mode():
        for m in gemm_warmup_token_counts(max_num_tokens):
            for mod in shapes.values():
                if isinstance(mod, LMHead) and m > max_logit_rows:
                    continue
                k = int(mod.weight.shape[1])
                mod(torch.empty(m, k, dtype=step.dtype, device=step.device))


def _forward(
    step: ModelStep, md: CommonAttentionMetadata, caches: KVCaches | None, num_logits: int
) -> None:
    with torch.inference_mode():
        hidden = step.hidden(md, caches)
        step.logits(hidden[-num_logits:])


def dummy_prompt_run(step: ModelStep, num_tokens: int, max_num_reqs: int) -> None:
    """A forward over ``num_tokens`` tokens of one request, on throwaway caches of just
    enough blocks (also the activation peak the GPU memory profile measures)."""
    n = min(num_tokens, step.max_model_len)
    dev = step.device
    bs = step.kv_cache_config.block_size
    nblk = cdiv(n, bs)
    caches = KVCaches.allocate(step.kv_cache_config, nblk + 1, dev)
    md = CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        block_size=bs,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(1, nblk + 1, dtype=torch.int32, device=dev).unsqueeze(0),
        slot_mapping=torch.arange(bs, bs + n, device=dev),
        token_req_idx=torch.zeros(n, dtype=torch.int64, device=dev),
        token_q_idx=torch.arange(n, device=dev),
    )
    _forward(step, md, caches, max_num_reqs)


def _null_block_table(step: ModelStep, num_reqs: int, num_blocks: int) -> torch.Tensor:
    """Block-table rows pointing at the null block, as a view of the static device
    buffer: Triton specialises a kernel on its integer arguments (a row stride divisible
    by 16 or not), so a dummy table must have the row stride traffic will have."""
    bt = step.buffers.block_tables.dev[:num_reqs, :num_blocks]
    bt.zero_()
    return bt


def _null_block_forward(step: ModelStep, q_lens: list[int]) -> None:
    """A forward of requests with ``q_lens`` new tokens, each after one cached block,
    through the real KV cache but reading and writing only the null block."""
    dev = step.device
    bs = step.kv_cache_config.block_size
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
        block_tables=_null_block_table(step, n, cdiv(max(seq_lens), bs)),
        slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),
        token_req_idx=torch.tensor([i for i, q in enumerate(q_lens) for _ in range(q)], device=dev),
        token_q_idx=torch.tensor([j for q in q_lens for j in range(q)], device=dev),
    )
    _forward(step, md, None, n)


def dummy_paged_runs(step: ModelStep, max_num_tokens: int) -> None:
    """Mixed batches (a chunk with a cached prefix next to a decode token) on the null
    block: they compile the paged prefill kernel, which the single-prompt dummies never
    reach (those take the SDPA path), for each of its tile sizes. Without this, the first
    chunked prompt or mixed step after start-up paid the kernel's compilation."""
    if step.buffers.block_tables.dev.shape[0] < 2:
        return  # max_num_seqs 1: no step ever mixes two requests
    bs = step.kv_cache_config.block_size
    for q in PAGED_WARMUP_QUERY_LENS:
        q_lens = [min(q, max_num_tokens - 1), 1]
        if max(q_lens) + bs <= step.max_model_len:
            _null_block_forward(step, q_lens)


def dummy_uniform_runs(step: ModelStep, max_num_tokens: int) -> None:
    """One request of ``q`` new tokens after a cached block, for every ``q`` up to
    ``MAX_UNIFORM_QUERY_LEN``, on the null block: a batch in which every request has the
    same short query (a short prompt, or a speculative verify) goes to the decode kernel,
    whose tile config depends on ``q``. Without this the first 8-token prompt after
    start-up paid a compile."""
    from pdserve.layers.attention.triton_backend import (
        MAX_UNIFORM_QUERY_LEN,
        TritonAttentionBackend,
    )

    if not any(isinstance(b, TritonAttentionBackend) for b in step.backends.values()):
        return
    bs = step.kv_cache_config.block_size
    for q in range(1, min(MAX_UNIFORM_QUERY_LEN, max_num_tokens) + 1):
        if q + bs <= step.max_model_len:
            _null_block_forward(step, [q])


def dummy_samples(sampler: Sampler, vocab_size: int, dev: torch.device) -> None:
    """Run every sampler variant once (greedy; random with each combination of a greedy
    row, top-k, top-p and min-p: the Triton kernel compiles one variant per combination)
    so none is compiled under traffic."""
    n = 2
    logits = torch.randn(n, vocab_size, device=dev)
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
    sampler(logits, greedy)
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
        sampler(logits, md)
