"""Synthetic request datasets; only vLLM's ``random`` dataset is implemented.

``sample_random_requests`` reproduces ``vllm.benchmarks.datasets.RandomDataset``:
one ``numpy.random.default_rng(seed)`` stream drawn in the same order (input
lengths, output lengths, offsets, shared prefix, then per-request padding), so a
tokenizer that behaves like vLLM's yields the same prompts as ``vllm bench serve``.

Invariants of the result, for every request ``i``:

* ``prompt_len == len(tokenizer.encode(prompt, add_special_tokens=False))``;
* the sampled body length lies in ``[floor(L'(1-r)), ceil(L'(1+r))]`` with
  ``L' = max(0, input_len - num_special_tokens_to_add)``; output lengths in
  ``[max(1, floor(O(1-r))), max(1, ceil(O(1+r)))]``;
* the first ``prefix_len`` token ids before decoding are the same for all requests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.errors import BenchError
from pdserve.bench.tokenizer import TokenizerLike

logger = logging.getLogger(__name__)

SUPPORTED_DATASETS = ("random",)
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_RANGE_RATIO = 0.0
DEFAULT_PREFIX_LEN = 0
_MAX_RETRY = 10


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request before it is sent.

    ``prompt_len`` is the local tokenizer's count (``add_special_tokens=False``); the
    server's ``usage.prompt_tokens`` replaces it in the results when reported.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str


def length_bounds(length: int, range_ratio: float, floor_one: bool) -> tuple[int, int]:
    """Closed integer interval ``[floor(L(1-r)), ceil(L(1+r))]`` (optionally floored at 1)."""
    low = math.floor(length * (1.0 - range_ratio))
    high = math.ceil(length * (1.0 + range_ratio))
    if floor_one:
        low, high = max(low, 1), max(high, 1)
    return low, high


def decode_to_target_len(
    tokenizer: TokenizerLike,
    token_ids: Sequence[int],
    target_len: int,
    rng: np.random.Generator,
    max_retry: int = _MAX_RETRY,
) -> tuple[str, list[int], int]:
    """Decode ``token_ids`` to text whose re-encoding has exactly ``target_len`` tokens.

    Some token runs re-tokenize differently after decoding (BPE merges across token
    boundaries), so the text is decoded, re-encoded and the ids truncated, or padded
    with random ids, up to ``max_retry`` times. Returns ``(prompt, ids, mismatch)``
    where ``ids == encode(prompt)`` and ``mismatch = len(ids) - target_len`` (0 when
    the target was met).
    """
    seq = [int(t) for t in token_ids]
    remaining = max_retry
    while True:
        prompt = tokenizer.decode(seq)
        seq = tokenizer.encode(prompt, add_special_tokens=False)
        if remaining <= 0:
            return prompt, seq, len(seq) - target_len
        if len(seq) == target_len:
            return prompt, seq, 0
        if len(seq) < target_len:
            pad = rng.integers(0, tokenizer.vocab_size, size=target_len - len(seq))
            seq.extend(int(t) for t in pad)
        else:
            seq = seq[:target_len]
        remaining -= 1


def sample_random_requests(
    tokenizer: TokenizerLike,
    num_requests: int,
    input_len: int = DEFAULT_INPUT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    range_ratio: float = DEFAULT_RANGE_RATIO,
    prefix_len: int = DEFAULT_PREFIX_LEN,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """Build ``num_requests`` random-token prompts exactly as vLLM's RandomDataset."""
    if num_requests < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {num_requests}")
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 0 or output_len < 0 or prefix_len < 0:
        raise BenchError("--random-input-len/--random-output-len/--random-prefix-len must be >= 0")
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_input_len = max(0, int(input_len) - num_special)
    in_low, in_high = length_bounds(real_input_len, range_ratio, floor_one=False)
    out_low, out_high = length_bounds(int(output_len), range_ratio, floor_one=True)
    if prefix_len + in_low < 1:
        raise BenchError(
            f"--random-input-len {input_len} is too small: with {num_special} special "
            f"token(s) and --random-range-ratio {range_ratio} a prompt could have "
            f"{prefix_len + in_low} tokens; increase --random-input-len or "
            "--random-prefix-len, or decrease --random-range-ratio"
        )
    vocab_size = int(tokenizer.vocab_size)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(tokenizer.all_special_ids, dtype=int))
    if allowed.size == 0:
        raise BenchError("the tokenizer has no non-special tokens to sample from")

    rng = np.random.default_rng(seed)
    logger.info(
        "Sampling input_len from [%s, %s] and output_len from [%s, %s]",
        in_low,
        in_high,
        out_low,
        out_high,
    )
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    prefix: list[int] = (
        allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    )

    requests: list[SampleRequest] = []
    mismatch_total = 0
    for i in range(num_requests):
        body_len = int(input_lens[i])
        body = allowed[(int(offsets[i]) + i + np.arange(body_len)) % len(allowed)].tolist()
        prompt, ids, mismatch = decode_to_target_len(
            tokenizer, prefix + body, prefix_len + body_len, rng
        )
        mismatch_total += mismatch
        requests.append(
            SampleRequest(
                prompt=prompt,
                prompt_len=len(ids),
                expected_output_len=int(output_lens[i]),
                request_id=f"{request_id_prefix}{i}",
            )
        )
    if mismatch_total:
        logger.warning(
            "Across all generated prompts there were %d %s tokens than expected after "
            "decoding and re-encoding.",
            abs(mismatch_total),
            "more" if mismatch_total > 0 else "fewer",
        )
    return requests
