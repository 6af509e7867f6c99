"""``--scheduling-policy priority``: waiting requests run by (priority, arrival), lower
first; preemption takes the lowest-priority running request; fcfs refuses a priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.engine.request import Request


def _first_token_order(llm: LLM, priorities: list[int]) -> list[int]:
    core = llm.engine
    for i, p in enumerate(priorities):
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=p)
        core.add_request(EngineCoreRequest(f"r{i}", [5, 6, 7], sp, [2], 2, float(i)))
    order: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            i = int(out.request_id[1:])
            if out.new_token_ids and i not in order:
                order.append(i)
    return order


def test_priority_orders_admission_and_picks_the_victim(tiny_llama: Path) -> None:
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        max_model_len=256,
        max_num_seqs=1,  # one at a time: admission order is the first-token order
        scheduling_policy="priority",
    )  # (max_num_seqs 1 also covers the warm-up, whose mixed-batch dummy needs 2 rows)
    assert _first_token_order(llm, [5, 0, 3, 0]) == [1, 3, 2, 0]  # ties by arrival

    sched = llm.engine.scheduler
    reqs = []
    for i, p in enumerate([1, 7, 3]):
        sp = SamplingParams(max_tokens=1, priority=p)
        reqs.append(Request(EngineCoreRequest(f"v{i}", [5], sp, [2], 1, float(i))))
    sched.running.extend(reqs)
    assert sched.queues.victim(0) is reqs[1]  # the lowest priority (highest value)
    assert sched.queues.victim(1) is reqs[2]  # only among those not scheduled yet
    sched.running.clear()

    from pdserve.frontend.processor import InputProcessor

    fcfs = InputProcessor(llm.tokenizer, 256, llm.engine.vocab_size)  # priority_scheduling off
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        fcfs.make_request("x", [5], SamplingParams(priority=1))
    assert llm.processor.make_request("y", [5], SamplingParams(priority=-3)).request_id == "y"
