"""Leases on prefill-held blocks: the prefill side's bookkeeping of what decode may still read.

Thread-safety: the KV server thread (reads, heartbeats, done notices) and the
scheduler thread (registration, expiry sweeps, proxy releases) share one table under
a lock. An entry being read is never expired, so blocks cannot be freed under a read.

A lease may be read at most ``max_reads`` times (``max_reads_per_lease``, default 1:
decode reads once): past that :meth:`begin_read` raises :class:`ReadLimitError`, so no
peer can keep re-reading (and pinning) held KV.

A lease is bound to its prompt and, from its first read on, to one consumer: a read must
name the digest of the prompt the KV was computed for (``prompt_digest``, see
:func:`pdserve.core_types.pd_auth.prompt_digest`) and the decode engine that first read
it (``consumer``); any other read is refused (:class:`ReadRefused`), so one prompt's KV
is served to one decode instance, for that prompt only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Lease:
    block_ids: list[int]
    expiry: float
    reading: int = 0  # reads in progress
    reads: int = 0  # reads begun, in all
    finished: bool = False  # done/released while a read was in flight: free after it
    prompt_digest: str | None = None  # the prompt the KV is for (None: unbound, tests only)
    consumer: str | None = None  # the decode engine that read it first


class ReadRefused(RuntimeError):
    """A read the lease does not allow."""


class ReadLimitError(ReadRefused):
    """The lease was read as often as it may be."""


class LeaseTable:
    def __init__(self, initial_seconds: float, max_reads: int = 1) -> None:
        self.initial = initial_seconds
        self.max_reads = max_reads
        self.extension = initial_seconds * 2 / 3
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._done: list[str] = []  # read complete / cancelled / released: free these
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def add(self, request_id: str, block_ids: list[int], prompt_digest: str | None = None) -> None:
        with self._lock:
            self._leases[request_id] = Lease(
                list(block_ids), time.monotonic() + self.initial, prompt_digest=prompt_digest
            )

    def renew(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None:
                    lease.expiry = max(lease.expiry, now + self.extension)

    def begin_read(
        self, request_id: str, prompt_digest: str = "", consumer: str = ""
    ) -> list[int] | None:
        """The held blocks of ``request_id`` (pinned against expiry until :meth:`end_read`),
        or None if not held; :class:`ReadRefused` for a read of another prompt or by
        another consumer than the first, :class:`ReadLimitError` once it was read
        ``max_reads`` times."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.finished:
                return None
            if lease.prompt_digest is not None and prompt_digest != lease.prompt_digest:
                raise ReadRefused(
                    f"the KV of request {request_id!r} was computed for another prompt than "
                    "the one decode asks it for (prompt digests differ)"
                )
            if lease.consumer is not None and consumer != lease.consumer:
                raise ReadRefused(
                    f"the KV of request {request_id!r} is served to another decode instance"
                )
            if lease.reads >= self.max_reads:
                raise ReadLimitError(
                    f"the KV of request {request_id!r} was read {lease.reads} times already "
                    f"(max_reads_per_lease {self.max_reads})"
                )
            lease.consumer = consumer
            lease.reads += 1
            lease.reading += 1
            return lease.block_ids

    def end_read(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.reading -= 1
                if lease.finished and not lease.reading:
                    del self._leases[request_id]
                    self._done.append(request_id)

    def finish(
        self, request_id: str, prompt_digest: str | None = None, consumer: str | None = None
    ) -> bool:
        """Decode is done with it (read, cancelled) or the proxy released it: free soon
        (after the read in flight, if one is: blocks are never freed under a read). A
        decode's notice names its prompt's digest and its engine id: one for another
        prompt, or from another consumer than the lease's reader, is
        :class:`ReadRefused` (the lease stays)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.finished:
                return False
            if prompt_digest is not None and lease.prompt_digest not in (None, prompt_digest):
                raise ReadRefused(f"request {request_id!r}'s KV was computed for another prompt")
            if consumer is not None and lease.consumer not in (None, consumer):
                raise ReadRefused(f"request {request_id!r}'s KV is read by another decode")
            if lease.reading:
                lease.finished = True
                return True
            del self._leases[request_id]
            self._done.append(request_id)
            return True

    def take_done(self) -> list[str]:
        with self._lock:
            out, self._done = self._done, []
            return out

    def take_expired(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            out = [
                r for r, lease in self._leases.items() if lease.expiry < now and not lease.reading
            ]
            for r in out:
                del self._leases[r]
            self.num_expired += len(out)
            return out
