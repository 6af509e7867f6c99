"""Engine requests for unit tests, built the one way the engine builds them."""

from __future__ import annotations

import time

from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.engine.request import Request


def make_request(
    rid: str, ids: list[int], sp: SamplingParams | None = None, max_output_tokens: int = 16
) -> Request:
    sp = sp or SamplingParams()
    return Request(EngineCoreRequest(rid, list(ids), sp, [], max_output_tokens, time.monotonic()))


PROMPT_LENS = (3, 17, 40, 9, 64, 1, 33)


def random_prompts(
    vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0
) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def outputs(llm, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:  # type: ignore[no-untyped-def]
    """(token ids, finish reason, stop reason) of each prompt, through ``llm.generate``."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs
    ]


def assert_clean(llm) -> None:  # type: ignore[no-untyped-def]
    """Every block free, no runner row, no request left (after the step in flight)."""
    for _ in range(2):  # finish the step in flight, then let the runner drop its rows
        llm.engine.step()
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_usable_blocks and not kv.req_blocks
    assert len(llm.engine.runner.batch) == 0 and not llm.engine.scheduler.requests
