"""The per-step agreement of data-parallel ranks that share expert-parallel MoE layers.

With expert parallelism every MoE layer is a collective over the DP ranks, so every rank
must run a forward in every step in which any rank runs one, and the forwards must match:
the same number of MoE layers, and, where a step replays a CUDA graph, the same graph on
every rank (the graph's collectives have the captured shapes). Without expert
parallelism the ranks are independent replicas and never call this.

Lifecycle: each engine-core loop iteration on every rank calls :meth:`DPStepSync.agree`
exactly once, after scheduling and before launching the step, with its :class:`LocalStep`.
It is one ``max`` all-reduce of a small integer vector over the DP group's gloo group; it
blocks until every rank has called it (a dead peer makes it raise). From the returned
:class:`StepPlan` every rank derives the same decisions:

- ``any_busy``: some rank runs real tokens; a rank with nothing scheduled runs a dummy
  forward of the agreed kind (no scheduler or KV state changes, writes the null block).
- ``uniform_q`` / ``max_reqs``: every busy rank runs a uniform batch of ``uniform_q``
  tokens per request (a decode or verify batch), so all may replay the graph keyed by
  (capture size for ``max_reqs``, ``uniform_q``); otherwise all run eagerly.
- ``stop``: a rank read ``Shutdown``; every rank leaves its loop after this step, so
  none is left waiting in a collective for a peer that is gone.
- ``keep_stepping``: whether the ranks must run the next agreement promptly (someone has
  work, or unfinished requests waiting for KV or a grammar, or a wake message is still
  on its way to a rank). When False every rank waits on its input socket.

Wake sequence: the client sends work to one rank and a ``Wake(seq)`` (seq increasing) to
every rank, after the work on the owner's socket. A rank reports the highest seq it has
read; when ranks disagree, the ones behind wait for their wake (which follows their work)
before the next agreement, so work that was in flight during an agreement is seen in the
next one, and no rank sleeps while another waits for it in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.distributed.groups import Group

_NON_UNIFORM = 1 << 40  # "this rank's batch is not uniform": larger than any real q
_NO_CONSTRAINT = -(1 << 40)


@dataclass(frozen=True)
class LocalStep:
    """One rank's view of the step it is about to launch."""

    num_tokens: int  # tokens scheduled this step (0: nothing to run)
    num_reqs: int
    uniform_q: int | None  # tokens per request when every request computes the same number
    pending: bool  # unfinished requests (scheduled or not: waiting for KV, a grammar)
    wake_seq: int  # highest wake sequence number this rank has read
    stopping: bool = False  # this rank read Shutdown

    def encode(self) -> list[int]:
        busy = self.num_tokens > 0
        if not busy:
            q_hi, q_lo_neg = 0, _NO_CONSTRAINT
        elif self.uniform_q is None:
            q_hi, q_lo_neg = _NON_UNIFORM, 0
        else:
            q_hi, q_lo_neg = self.uniform_q, -self.uniform_q
        return [
            int(busy),
            self.num_tokens,
            self.num_reqs if busy else 0,
            q_hi,
            q_lo_neg,
            int(self.pending),
            self.wake_seq,
            -self.wake_seq,
            int(self.stopping),
        ]


@dataclass(frozen=True)
class StepPlan:
    """What every rank agreed on for one step (identical on every rank)."""

    any_busy: bool
    max_tokens: int
    max_reqs: int
    uniform_q: int | None  # set when every busy rank runs uniform batches of this q
    any_pending: bool
    max_wake_seq: int
    wake_seq_agrees: bool
    stop: bool = False

    @property
    def keep_stepping(self) -> bool:
        return self.any_busy or self.any_pending or not self.wake_seq_agrees

    @classmethod
    def decode(cls, v: list[int]) -> StepPlan:
        busy, tokens, reqs, q_hi, q_lo_neg, pending, seq_hi, seq_lo_neg, stop = v
        q_lo = -q_lo_neg
        uniform = q_hi if busy and q_hi == q_lo and 0 < q_hi < _NON_UNIFORM else None
        return cls(
            any_busy=bool(busy),
            max_tokens=tokens,
            max_reqs=reqs,
            uniform_q=uniform,
            any_pending=bool(pending),
            max_wake_seq=seq_hi,
            wake_seq_agrees=seq_hi == -seq_lo_neg,
            stop=bool(stop),
        )


class DPStepSync:
    """The agreement over one DP group (see the module docstring)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.num_agreements = 0

    def agree(self, local: LocalStep) -> StepPlan:
        self.num_agreements += 1
        return StepPlan.decode(self.group.max_cpu(local.encode()))
