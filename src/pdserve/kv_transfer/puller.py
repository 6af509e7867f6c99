"""The decode instance's transfers: handshakes, block reads, heartbeats, done notices.

Each prefill endpoint (host, port) gets its own worker thread, job queue and
connection (:class:`PeerLink`), so a dead, slow or fake peer delays only its own jobs:
jobs of different peers run concurrently. Within one peer, notices (heartbeats, done)
go before queued reads, so leases keep being renewed behind a long read queue.

A handshake that times out (or is not authenticated) marks the peer down for
``handshake_timeout`` seconds: its queued jobs fail at once meanwhile, rather than
each waiting out a handshake of its own; the next job after that dials again.

Every job has a deadline set when it is queued (a read: ``handshake_timeout +
transfer_timeout``; a heartbeat: ``handshake_timeout``; a done notice: twice that);
each wait on the wire is cut to the time left, and a job that waited past its deadline
fails (a read) or is dropped (a notice: the next heartbeat, or the lease's expiry,
supersedes it) without touching the wire.

The scheduler side enqueues jobs once per step and drains results once per step
(:meth:`take_results`). A peer that times out, refuses or answers unauthenticated is
dropped and handshaken again on its next job. An endpoint outside ``allowed_prefill``
is never dialled (its reads fail at once), and at most ``max_peers`` endpoints have a
worker at a time; a worker idle for ``idle_seconds`` closes its connection and exits.

A read carries the load's fence, if it has one (``transports.base``: the engine's work
issued before the load, which may still write into its blocks) down to the transport,
which writes nothing into local blocks before the fence has completed.

Supervision: :meth:`supervise` (the connector calls it from the engine's thread)
finds workers that died (a ``BaseException`` escaped), fails the read they were doing,
and starts a new thread on the same queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pdserve.core_types.kv_connector import KVLoad, KVNotice, KVPeer
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.peer_link import PeerLink
from pdserve.kv_transfer.transports.base import ClientTransport, Fence, PendingWrite

logger = logging.getLogger(__name__)

_STOP, _HEARTBEAT, _DONE, _LOAD = range(4)  # job kinds, in priority order
_KIND_NAME = {_HEARTBEAT: "heartbeat", _DONE: "done", _LOAD: "read"}
_IDLE_CHECK_S = 1.0
_LANDING_POLL_S = 0.00005  # while a write lands: how often to look for notices to send


@dataclass
class LoadResult:
    request_id: str
    error: str | None
    seconds: float
    nbytes: int


@dataclass(order=True)
class _Job:
    kind: int
    seq: int
    deadline: float = field(compare=False)
    arg: Any = field(compare=False, default=None)
    fence: Fence | None = field(compare=False, default=None)  # a read's (if any)


@dataclass
class _Worker:
    peer: KVPeer
    jobs: queue.PriorityQueue[_Job]
    thread: threading.Thread | None = None
    link: PeerLink | None = None
    current: _Job | None = None
    finished: bool = False  # exited normally (stop or idle), not died
    death: str | None = None
    # the last handshake timed out or was not authenticated: until down_until, jobs
    # fail at once instead of each waiting out a handshake of its own
    down_at: float = 0.0
    down_until: float = 0.0
    down_why: str = ""
    last_active: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return f"{self.peer.host}:{self.peer.port}"


class KVPuller:
    def __init__(
        self,
        compat: dict[str, Any],
        make_client: Callable[[dict[str, Any]], ClientTransport],
        handshake_timeout: float,
        transfer_timeout: float,
        secret: bytes,
        *,
        max_ids_per_message: int = 1024,
        allowed: frozenset[tuple[str, int]] | None = None,
        max_peers: int = 64,
        idle_seconds: float = 60.0,
        consumer: str = "",
    ) -> None:
        self.compat = compat
        self.make_client = make_client
        self.handshake_timeout = handshake_timeout
        self.transfer_timeout = transfer_timeout
        self.secret = secret
        self.max_ids = max_ids_per_message
        self.allowed = allowed
        self.max_peers = max_peers
        self.idle_seconds = idle_seconds
        self.consumer = consumer  # this decode engine's id: named in every read
        self._ctx = zmq.Context()
        self._workers: dict[tuple[str, int], _Worker] = {}  # (host, port) -> its worker
        self._results: list[LoadResult] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = itertools.count()
        self.num_restarts = 0

    # -- called from the scheduler thread --------------------------------------------------
    def load(self, job: KVLoad, after: Fence | None = None) -> None:
        """Queue a read; ``after``: its fence (none on a CPU cache)."""
        budget = self.handshake_timeout + self.transfer_timeout
        why = self._submit(job.peer, _LOAD, budget, job, after)
        if why is not None:
            self._result(
                job.request_id, f"KV transfer from prefill {_name(job.peer)} refused: {why}"
            )

    def notify_done(self, notice: KVNotice) -> None:
        self._notice(notice, _DONE, 2 * self.handshake_timeout)

    def heartbeat(self, notice: KVNotice) -> None:
        self._notice(notice, _HEARTBEAT, self.handshake_timeout)

    def take_results(self) -> list[LoadResult]:
        with self._lock:
            out, self._results = self._results, []
            return out

    @property
    def num_peers(self) -> int:
        with self._lock:
            return len(self._workers)

    def supervise(self) -> list[str]:
        """Restart workers that died; one line per restart (what died and why)."""
        restarted = []
        with self._lock:
            for w in self._workers.values():
                if w.thread is None or w.thread.is_alive() or w.finished:
                    continue
                why = f"KV puller worker for prefill {w.name} died ({w.death or 'no reason'})"
                job, w.current = w.current, None
                if job is not None and job.kind == _LOAD:
                    self._results.append(LoadResult(job.arg.request_id, why, 0.0, 0))
                if w.link is not None:
                    w.link.close()
                    w.link = None
                self._start(w)
                self.num_restarts += 1
                restarted.append(why)
        return restarted

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            workers = list(self._workers.values())
            for w in workers:
                w.jobs.put(_Job(_STOP, next(self._seq), 0.0))
        deadline = time.monotonic() + 5.0
        for w in workers:
            if w.thread is not None:
                w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [w.name for w in workers if w.thread is not None and w.thread.is_alive()]
        if stuck:  # a socket still in use: leave the context to the process exit
            logger.warning("KV puller: workers for %s did not stop in time", ", ".join(stuck))
            return
        for w in workers:
            w.link = None
        self._ctx.destroy(linger=0)  # closes every socket left (a dead worker's too)

    # -- queueing ----------------------------------------------------------------------------
    def _notice(self, notice: KVNotice, kind: int, budget: float) -> None:
        ids, digests, n = notice.request_ids, notice.prompt_digests, self.max_ids
        for i in range(0, len(ids), n):  # prefill refuses longer notices
            part = KVNotice(notice.peer, ids[i : i + n], digests[i : i + n])
            why = self._submit(notice.peer, kind, budget, part)
            if why is not None:
                logger.warning(
                    "KV %s to %s not sent: %s", _KIND_NAME[kind], _name(notice.peer), why
                )
                return

    def _submit(
        self, peer: KVPeer, kind: int, budget: float, arg: Any, fence: Fence | None = None
    ) -> str | None:
        """Queue a job on ``peer``'s worker; why not, if it is refused."""
        addr = (peer.host, peer.port)
        if self.allowed is not None and addr not in self.allowed:
            return "the endpoint is not in allowed_prefill (kv_connector_extra_config)"
        if self._stop.is_set():
            return "the KV puller is shut down"
        with self._lock:
            w = self._workers.get(addr)
            if w is None:
                if len(self._workers) >= self.max_peers:
                    return f"already connected to max_prefill_peers={self.max_peers} endpoints"
                w = self._workers[addr] = _Worker(peer, queue.PriorityQueue())
                self._start(w)
            w.jobs.put(_Job(kind, next(self._seq), time.monotonic() + budget, arg, fence))
        return None

    def _start(self, w: _Worker) -> None:
        w.finished, w.death = False, None
        w.last_active = time.monotonic()
        w.thread = threading.Thread(
            target=self._work, args=(w,), name=f"pdserve-kv-puller-{w.name}", daemon=True
        )
        w.thread.start()

    def _result(
        self,
        request_id: str,
        error: str | None,
        seconds: float = 0.0,
        nbytes: int = 0,
        w: _Worker | None = None,
    ) -> None:
        """Report a read; ``w``'s job is then no longer in flight (its death cannot
        report it a second time)."""
        with self._lock:
            self._results.append(LoadResult(request_id, error, seconds, nbytes))
            if w is not None:
                w.current = None

    # -- a peer's worker thread --------------------------------------------------------------
    def _work(self, w: _Worker) -> None:
        try:
            while True:
                try:
                    job = w.jobs.get(timeout=_IDLE_CHECK_S)
                except queue.Empty:
                    if self._retire_if_idle(w):
                        return
                    continue
                if job.kind == _STOP:
                    w.finished = True
                    return
                w.current = job
                try:
                    self._run_job(w, job)
                except Exception:  # never let one job kill the worker
                    logger.exception(
                        "KV puller: %s job for %s failed", _KIND_NAME[job.kind], w.name
                    )
                w.current = None
                w.last_active = time.monotonic()
        except BaseException as e:
            w.death = f"{type(e).__name__}: {e}"
            raise

    def _retire_if_idle(self, w: _Worker) -> bool:
        with self._lock:  # jobs are queued under this lock: none can slip in meanwhile
            if not w.jobs.empty() or time.monotonic() - w.last_active < self.idle_seconds:
                return False
            if self._workers.get((w.peer.host, w.peer.port)) is w:
                del self._workers[(w.peer.host, w.peer.port)]
            w.finished = True
        if w.link is not None:
            w.link.close()
            w.link = None
        return True

    def _run_job(self, w: _Worker, job: _Job) -> None:
        if job.kind == _LOAD:
            self._load(w, job)
            return
        left = job.deadline - time.monotonic()
        if left <= 0:
            logger.info("KV %s to %s dropped: past its deadline", _KIND_NAME[job.kind], w.name)
            return
        try:
            msg = _notice_msg(job, self.consumer)
            self._link(w, job).notify(msg, min(self.handshake_timeout, left))
        except Exception as e:
            logger.warning("KV side channel to %s: %s", w.name, e)
            self._drop(w)

    def _link(self, w: _Worker, job: _Job) -> PeerLink:
        """The worker's handshaken connection (dialled and handshaken if need be)."""
        peer: KVPeer = job.arg.peer
        if w.link is not None and peer.engine_id and peer.engine_id != w.link.engine_id:
            self._drop(w)  # the job names another engine: handshake anew (and check it)
        if w.link is not None:
            return w.link
        now = time.monotonic()
        if now < w.down_until:  # its last handshake found no one there: do not wait again
            raise ConnectionError(
                f"{w.down_why} ({now - w.down_at:.1f}s ago; not retried for "
                f"{w.down_until - now:.1f}s)"
            )
        link = PeerLink(self._ctx, self.secret, self.compat, self.make_client, peer, self._stop)
        try:
            link.handshake(min(self.handshake_timeout, max(0.001, job.deadline - now)))
        except BaseException as e:
            link.close()
            if isinstance(e, TimeoutError | W.Refused) and not self._stop.is_set():
                w.down_at = time.monotonic()
                w.down_until = w.down_at + self.handshake_timeout
                w.down_why = f"handshake failed: {e}"
            raise
        w.link = link
        return link

    def _drop(self, w: _Worker) -> None:
        if w.link is not None:
            w.link.close()
            w.link = None

    def _load(self, w: _Worker, job: _Job) -> None:
        load: KVLoad = job.arg
        t0 = time.perf_counter()
        link_ok = True
        try:
            if time.monotonic() >= job.deadline:
                raise TimeoutError("it waited in the queue past its deadline")
            link = self._link(w, job)
            rid = load.remote_request_id
            read = W.Read(
                rid,
                load.first_block,
                len(load.local_block_ids),
                load.num_blocks,
                load.prompt_digest,
                self.consumer,
            )
            left = max(0.001, job.deadline - time.monotonic())
            n = len(load.local_block_ids)
            expected = load.remote_block_ids[load.first_block : load.first_block + n]
            timeout = min(self.transfer_timeout, left)
            pending = link.start_read(
                read, load.local_block_ids, timeout, expected, after=job.fence
            )
            link_ok = self._notices_while(w, link, pending, job.deadline)
            nbytes = pending.wait()
        except Exception as e:
            err = f"KV transfer from prefill {w.name} failed: {e}"
            logger.warning("request %s: %s", load.request_id, err)
            self._drop(w)
            self._result(load.request_id, err, time.perf_counter() - t0, w=w)
            return
        self._result(load.request_id, None, time.perf_counter() - t0, nbytes, w=w)
        try:  # read complete: prefill may free now (the request need not wait for this)
            if not link_ok:  # a notice failed on it meanwhile: dial again
                self._drop(w)
                link = self._link(w, job)
            link.notify(W.Done([rid], [load.prompt_digest], self.consumer), self.handshake_timeout)
        except Exception as e:
            logger.warning("KV side channel to %s: done notice failed: %s", w.name, e)
            self._drop(w)

    def _notices_while(
        self, w: _Worker, link: PeerLink, pending: PendingWrite, deadline: float
    ) -> bool:
        """Until a write has landed (or the read's deadline), send this peer's heartbeats
        and done notices as they are queued, on the (idle) link; False if one failed
        (the link is then unusable)."""
        while not pending.ready() and time.monotonic() < deadline:
            job = _next_notice(w.jobs)
            if job is None:
                time.sleep(_LANDING_POLL_S)
                continue
            left = job.deadline - time.monotonic()
            if left <= 0:
                continue  # past its deadline: superseded by the next heartbeat or expiry
            try:
                link.notify(_notice_msg(job, self.consumer), min(self.handshake_timeout, left))
            except Exception as e:
                logger.warning("KV side channel to %s: %s", w.name, e)
                return False
        return True


def _next_notice(jobs: queue.PriorityQueue[_Job]) -> _Job | None:
    """The queue's first job if it is a heartbeat or done notice (they sort before
    reads; a stop or a read stays queued)."""
    with jobs.mutex:
        if not jobs.queue or jobs.queue[0].kind not in (_HEARTBEAT, _DONE):
            return None
    try:
        job = jobs.get_nowait()  # (this thread is the queue's only consumer)
    except queue.Empty:
        return None
    if job.kind not in (_HEARTBEAT, _DONE):  # a stop was queued in between: keep it
        jobs.put(job)
        return None
    return job


def _notice_msg(job: _Job, consumer: str) -> W.Done | W.Heartbeat:
    notice: KVNotice = job.arg
    if job.kind == _DONE:
        return W.Done(notice.request_ids, notice.prompt_digests, consumer)
    return W.Heartbeat(notice.request_ids)


def _name(peer: KVPeer) -> str:
    return f"{peer.host}:{peer.port}"
