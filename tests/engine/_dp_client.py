"""A multi-rank ``AsyncEngineClient`` driven from synchronous tests: the client lives on
an event loop in a background thread; every call waits with a timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.frontend.async_client import AsyncEngineClient
from pdserve.frontend.outputs import RequestOutput

T = TypeVar("T")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 500 + 3 for j in range(4 + 7 * i)] for i in range(n)]


class ClientThread:
    def __init__(self, path: Path, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = EngineConfig.from_kwargs(
            model=str(path), dtype="float32", block_size=4, device="cpu", **kwargs
        )
        self.client: AsyncEngineClient = self.call(
            AsyncEngineClient.start(cfg, log_level="WARNING"), 240
        )

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _one(
        self,
        rid: str,
        ids: list[int],
        sp: SamplingParams,
        kv: KVTransferParams | None = None,
    ) -> tuple[list[int], RequestOutput]:
        toks: list[int] = []
        last = None
        async for out in self.client.generate(rid, None, ids, sp, kv):
            toks += out.outputs[0].token_ids
            last = out
        assert last is not None and last.finished
        return toks, last

    def generate(
        self,
        batch: list[list[int]],
        sp: SamplingParams = GREEDY,
        prefix: str = "r",
        kv: KVTransferParams | None = None,
        timeout: float = 60,
    ) -> list[tuple[list[int], RequestOutput]]:
        """Every prompt at once (concurrently); results in prompt order."""

        async def all_() -> list[tuple[list[int], RequestOutput]]:
            jobs = [self._one(f"{prefix}{i}", p, sp, kv) for i, p in enumerate(batch)]
            return list(await asyncio.gather(*jobs))

        return self.call(all_(), timeout)

    def close(self) -> None:
        try:
            self.call(self.client.shutdown(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
