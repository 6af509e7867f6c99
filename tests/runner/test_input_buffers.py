"""Packed uploads keep every segment 16-byte aligned, so the request-state kernels see the
same pointer alignment at every batch size (Triton specialises on it: an odd batch used to
put ``nsched`` at an odd int64 offset and compile ``post_update`` anew under traffic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve import LLM, SamplingParams
from pdserve.runner.input_buffers import ALIGN_BYTES, PACK_SLACK, BufferPair


def test_upload_packed_aligns_each_segment() -> None:
    buf = BufferPair(3 * 5 + PACK_SLACK, torch.int64, torch.device("cpu"))
    parts = [np.arange(n, dtype=np.int64) + 10 * n for n in (3, 0, 5, 1, 2, 1)]
    views = buf.upload_packed(parts)
    for p, v in zip(parts, views, strict=True):
        assert v.data_ptr() % ALIGN_BYTES == 0
        assert v.tolist() == p.tolist()


def test_upload_packed_reuses_the_views_of_a_layout() -> None:
    """A layout seen before gets its views back (no split a step) with the new values."""
    buf = BufferPair(64 + PACK_SLACK, torch.int64, torch.device("cpu"))
    first = buf.upload_packed([np.array([1, 2]), np.array([3])])
    other = buf.upload_packed([np.array([4]), np.array([5, 6])])
    again = buf.upload_packed([np.array([7, 8]), np.array([9])])
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert [v.tolist() for v in again] == [[7, 8], [9]]
    assert other[1] is not first[1] and other[1].shape == (2,)


def test_request_state_arguments_are_aligned_at_an_odd_batch(tiny_llama: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, speculative_config=spec)
    eng, state = llm.engine, llm.engine.runner.state
    seen: list[tuple[str, int]] = []

    def watch(name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            for x in (*a, *k.values()):
                if isinstance(x, torch.Tensor):
                    seen.append((name, x.data_ptr() % ALIGN_BYTES))
            return fn(*a, **k)

        return wrapped

    state.post_update = watch("post_update", state.post_update)  # type: ignore[method-assign]
    state.place = watch("place", state.place)  # type: ignore[method-assign]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):  # an odd batch, prompts of different lengths
        eng.add_request(llm.processor.make_request(f"r{i}", [5, 6, 7, 8, 5, 6, 7][: 3 + i], sp))
    for _ in range(40):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    assert {n for n, _ in seen} == {"post_update", "place"}
    assert all(off == 0 for _, off in seen), sorted(set(seen))
