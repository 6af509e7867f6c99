"""What the API server needs from an engine: the ``EngineClient`` protocol.

Implementations: ``frontend.async_client.AsyncEngineClient`` (talks to an engine-core
process over ZMQ). Tests may use an in-process fake with the same surface.

Lifecycle of one request: the handler checks it with ``processor`` (the input
processor, :mod:`pdserve.frontend.processor`: every rule, once per HTTP request, raising
``ValueError`` with a message and the field before anything is queued); ``generate``
takes one sample of it (a request of ``n`` samples is fanned out first) and
yields delta ``RequestOutput`` objects: each holds only the tokens/text new since
the previous one; the last has ``finished=True`` and a ``finish_reason``. If the
consumer stops iterating (client disconnect), the caller must call ``abort``; the
engine then frees the request's KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.stats import SchedulerStats
from pdserve.frontend.outputs import RequestOutput
from pdserve.frontend.processor import InputProcessor
from pdserve.frontend.tokenizer import Tokenizer


class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    priority_scheduling: bool  # --scheduling-policy priority: requests may set a priority

    @property
    def processor(self) -> InputProcessor:
        """The rules this engine's requests must pass."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def latest_stats(self) -> SchedulerStats: ...

    async def check_health(self) -> None:
        """Raise if the engine is dead."""
        ...

    async def shutdown(self) -> None: ...
