"""A stand-in for the model runner and the engine core's step loop, for unit tests of the
scheduler that see counts and token ids only (no model, no tensors).

The "model" samples :func:`truth` at every position, so a request's output is the same
however it is scheduled (chunked, preempted, speculated, synchronous or one step in
flight). :class:`FakeRunner` keeps what the device would per row (the tokens it knows, the
drafts it proposed last), fills ``-1`` placeholder drafts from those, accepts the leading
drafts that match the truth and proposes the next ones (wrong where ``wrong`` says).
:class:`Loop` drives the scheduler the way ``EngineCore.step`` does: synchronous, or one
step in flight with the previous step landed after the next is scheduled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.core_types.kv_connector import KVConnectorMetadata, KVConnectorOutput
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.messages import EngineCoreRequest
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import EngineCoreOutput, RunnerOutput, SchedulerOutput
from pdserve.engine.kv_cache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.base import ConnectorRequest, KVConnectorScheduler


def truth(rid: str, pos: int) -> int:
    """The token the model samples at position ``pos`` of request ``rid`` (10..98)."""
    return 10 + (sum(map(ord, rid)) * 7 + pos * 13) % 89


def request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    arrival: float = 0.0,
    remote: bool = False,
    **sp: object,
) -> Request:
    """A request of ``prompt_len`` prompt tokens (``remote``: its prompt's KV comes from a
    prefill instance)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp)  # type: ignore[arg-type]
    kvp = KVTransferParams(do_remote_prefill=True, remote_request_id=rid) if remote else None
    prompt = [1 + (ord(rid[-1]) + i) % 7 for i in range(prompt_len)]
    return Request(EngineCoreRequest(rid, prompt, params, [], max_tokens, arrival, kvp))


class FakeConnector(KVConnectorScheduler):
    """The decode side of a P/D connector, as counts: a request with remote params pulls
    every prompt token but the last; the test reports the pull's end."""

    def __init__(self) -> None:
        self.remote: set[str] = set()
        self.loads: list[tuple[str, int]] = []  # (request id, external tokens), per step
        self.freeable: list[str] = []
        self.given_up: list[str] = []

    def on_new_request(self, req: ConnectorRequest) -> None:
        if req.kv_transfer_params is not None:
            self.remote.add(req.request_id)

    def get_num_new_matched_tokens(
        self, req: ConnectorRequest, num_computed: int
    ) -> tuple[int, bool]:
        if req.request_id not in self.remote:
            return 0, False
        return max(0, req.num_prompt_tokens - 1 - num_computed), True

    def update_state_after_alloc(self, req: ConnectorRequest, block_ids: list[int], n: int) -> None:
        self.loads.append((req.request_id, n))
        self.remote.discard(req.request_id)

    def build_connector_meta(self) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(
        self, req: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        return False, None

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        pass

    def take_freeable(self) -> list[str]:
        out, self.freeable = self.freeable, []
        return out

    def give_up(self, req: ConnectorRequest) -> None:
        self.given_up.append(req.request_id)


def scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 8,
    max_model_len: int = 256,
    async_scheduling: bool = False,
    policy: str = "fcfs",
    chunked: bool = True,
    connector: KVConnectorScheduler | None = None,
    failure_policy: str = "fail",
    k: int = 0,
    lookahead: int = 0,
    pad_first_step: bool = False,
    prefix_caching: bool = True,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        async_scheduling=async_scheduling,
        scheduling_policy=policy,
    )
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(
        cfg,
        kv,
        max_model_len,
        connector,
        failure_policy,
        num_spec_tokens=k,
        num_lookahead_tokens=lookahead,
        pad_first_step=pad_first_step,
    )


def never(rid: str, pos: int) -> bool:
    return False


@dataclass
class FakeRunner:
    """The device side: per row the tokens it knows and its last proposal."""

    k: int = 0  # drafts proposed per sampling row (0: no drafter)
    wrong: Callable[[str, int], bool] = never  # the draft for (request, position) is wrong
    length: dict[str, int] = field(default_factory=dict)
    proposal: dict[str, list[int]] = field(default_factory=dict)
    verified: list[dict[str, list[int]]] = field(default_factory=list)  # drafts, per step

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.length.pop(rid, None)
            self.proposal.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.length[new.req_id] = len(new.token_ids)
            self.proposal.pop(new.req_id, None)
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        drafted: list[list[int]] = []
        step: dict[str, list[int]] = {}
        for rid in ids:
            if rid not in so.sampling_req_ids:
                sampled.append([])
                drafted.append([])
                continue
            known = self.proposal.get(rid, [])
            scheduled = so.scheduled_spec_decode_tokens.get(rid, [])
            drafts = [d if d >= 0 or j >= len(known) else known[j] for j, d in enumerate(scheduled)]
            step[rid] = drafts
            p0 = self.length[rid]
            acc = 0
            while acc < len(drafts) and drafts[acc] == truth(rid, p0 + acc):
                acc += 1
            sampled.append([truth(rid, p0 + j) for j in range(acc + 1)])
            self.length[rid] = p0 + acc + 1
            q = self.length[rid]
            nxt = [1 if self.wrong(rid, q + j) else truth(rid, q + j) for j in range(self.k)]
            self.proposal[rid] = nxt if so.propose_drafts else []
            drafted.append(self.proposal[rid])
        self.verified.append(step)
        return RunnerOutput(ids, sampled, draft_token_ids=drafted if self.k else None)


@dataclass
class Loop:
    """The engine core's step loop over a scheduler and a fake runner."""

    sched: Scheduler
    runner: FakeRunner = field(default_factory=FakeRunner)
    in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
    kv_out: KVConnectorOutput | None = None  # reported with the next step that lands
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    def land(self, so: SchedulerOutput, out: RunnerOutput) -> list[EngineCoreOutput]:
        out.kv_connector_output, self.kv_out = self.kv_out, None
        outs = self.sched.update_from_output(so, out)
        for o in outs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason
        self.outputs += outs
        return outs

    def step(self) -> SchedulerOutput:
        """One ``EngineCore.step``: returns the step it scheduled."""
        s = self.sched
        if self.in_flight is not None and s.waits_for_landed_tokens():
            prev, self.in_flight = self.in_flight, None
            self.land(*prev)
        so = s.schedule()
        if not s.async_scheduling:
            self.land(so, self.runner.execute(so))
            return so
        if so.masks_deferred and self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self.land(*prev)
        if so.masks_deferred:
            s.fill_masks(so)
        out = self.runner.execute(so)
        prev, self.in_flight = self.in_flight, (so, out)
        if prev is not None:
            self.land(*prev)
        return so

    def run(
        self, arrivals: dict[int, list[Request]] | None = None, max_steps: int = 100
    ) -> list[SchedulerOutput]:
        """Step until every request finished (bounded); ``arrivals``: requests added
        before the step of that index. Returns the steps scheduled."""
        arrivals = dict(arrivals or {})
        steps: list[SchedulerOutput] = []
        for i in range(max_steps):
            for req in arrivals.pop(i, []):
                self.sched.add_request(req)
            if not arrivals and not self.sched.has_unfinished_requests():
                return steps
            steps.append(self.step())
        raise AssertionError(f"not done after {max_steps} steps")
