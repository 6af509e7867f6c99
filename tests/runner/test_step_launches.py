"""A decode step through the step pipeline reads nothing back from the device (no host
sync: the step's one sync is landing its results), and the request state's
``post_update`` is one op without a drafter and a handful of torch ops with one (counted
on the CPU with the launch counter; on CUDA one launch,
tests/kernels/test_request_state_kernel.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve import LLM, SamplingParams
from pdserve.profiling.launch_count import LaunchCounter, LaunchCounts, format_table

SPECS: dict[str, tuple[dict[str, Any] | None, int]] = {
    "plain": (None, 1),  # (speculative config, most post_update launches)
    "ngram": ({"method": "ngram", "num_speculative_tokens": 2}, 12),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_decode_step_has_no_host_sync(tiny_llama: Path, name: str) -> None:
    spec, most = SPECS[name]
    kw = {"speculative_config": spec} if spec is not None else {}
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, async_scheduling=True, **kw)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.3)
    for i in range(3):
        eng.add_request(llm.processor.make_request(f"r{i}", [5, 6, 7, 8, 5, 6, 7][: 4 + i], sp))
    for _ in range(6):  # past the prompts: decode steps, one in flight
        eng.step()
    pipe, state = eng.pipeline, eng.runner.state
    launch, post_update = pipe.launch, state.post_update
    seen: dict[str, LaunchCounts] = {}

    def count(key: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            with LaunchCounter() as c:
                out = fn(*a, **k)
            seen[key] = c.counts
            return out

        return wrapped

    pipe.launch = count("launch", launch)  # type: ignore[method-assign]
    state.post_update = count("post_update", post_update)  # type: ignore[method-assign]
    eng.step()
    assert seen["launch"].total > 0 and not seen["launch"].syncs, format_table(seen["launch"])
    assert 0 < seen["post_update"].total <= most, format_table(seen["post_update"])
    eng.abort_requests([f"r{i}" for i in range(3)])
    eng.step()


def test_synchronous_step_without_drafter_skips_the_state(tiny_llama: Path) -> None:
    """At depth 0 without a drafter the next step's inputs are all known to the host, so
    a decode step neither records itself in the request state nor uploads the
    per-request device indices (the packed upload) or the sample mask; with one step in
    flight it does both."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, async_scheduling=False)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        eng.add_request(llm.processor.make_request(f"s{i}", [5, 6, 7, 8, 5, 6][: 4 + i], sp))
    for _ in range(4):
        eng.step()
    buf, state = eng.runner.buffers, eng.runner.state
    calls: list[str] = []

    def spy(owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return fn(*a, **k)

        setattr(owner, name, wrapped)

    spy(state, "post_update")
    spy(buf.packed, "upload_packed")
    spy(buf.samples, "upload")
    eng.step()
    assert calls == []
    eng.set_async_scheduling(True)
    for _ in range(2):
        eng.step()
    assert calls.count("post_update") == 2 and calls.count("upload_packed") == 2
    assert "upload" not in calls  # the sample mask only with a drafter
    eng.abort_requests([f"s{i}" for i in range(3)])
    eng.step()
