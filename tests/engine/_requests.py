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
    return Request(
        EngineCoreRequest(rid, list(ids), sp, [], max_output_tokens, time.monotonic())
    )
