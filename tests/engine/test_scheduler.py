from _requests import make_request

from pdserve.config import SchedulerConfig
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import RunnerOutput
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import Scheduler


def _sched(num_blocks=64, budget=16, max_seqs=8, block_size=4):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, 256)


def _req(rid, n, max_tokens=4):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    return make_request(rid, list(range(1, n + 1)), sp, max_tokens)


def _run(s, so, tok=7):
    return s.update_from_output(
        so, RunnerOutput(list(so.num_scheduled_tokens), [[tok]] * len(so.num_scheduled_tokens))
    )


def test_chunked_prefill_then_decode():
    s = _sched(budget=8)
    s.add_request(_req("a", 20))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 8}
    assert _run(s, so) == []  # partial chunk: no token
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 8}
    _run(s, so)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    outs = _run(s, so)
    assert [o.new_token_ids for o in outs] == [[7]]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1}


def test_running_first_and_budget():
    s = _sched(budget=10)
    s.add_request(_req("a", 6))
    _run(s, s.schedule())
    s.add_request(_req("b", 20))
    so = s.schedule()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 9)]


def test_finish_by_length_frees_blocks_and_reports_once():
    s = _sched()
    s.add_request(_req("a", 5, max_tokens=2))
    _run(s, s.schedule())
    outs = _run(s, s.schedule())
    assert outs[0].finish_reason == "length"
    assert s.kv.num_free_blocks == 63
    so = s.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty
    assert s.schedule().finished_req_ids == set()


def test_preemption_recomputes():
    s = _sched(num_blocks=5, budget=64, block_size=4)  # 4 usable blocks
    s.add_request(_req("a", 7, max_tokens=8))
    s.add_request(_req("b", 7, max_tokens=8))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    _run(s, so)
    for _ in range(3):
        so = s.schedule()
        _run(s, so)
    assert so.preempted_req_ids or s.stats.num_preemptions >= 1
    b = s.requests["b"]
    assert b.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)


def test_abort_waiting_and_running():
    s = _sched()
    s.add_request(_req("a", 5))
    s.add_request(_req("b", 5))
    _run(s, s.schedule())
    s.add_request(_req("c", 5))
    done = s.finish_requests(["a", "c", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"a", "c"}
    assert [r.request_id for r in s.running] == ["b"]
    assert not s.waiting
