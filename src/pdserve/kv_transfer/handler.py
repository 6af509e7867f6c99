"""What the prefill's KV server does with one side-channel message (no sockets here).

:meth:`KVRequestHandler.handle_frames` takes the frames of one message as the ROUTER
socket delivered them (the peer's identity first) and returns the frames to send back.
It never raises for any input: frames of the wrong count, a tag that does not verify
and a payload that does not decode are refused with an ``Error`` reply before anything
is decoded or acted upon, and counted by kind in :attr:`KVRequestHandler.rejected`. An
authenticated message outside a session, or one whose counter was seen (a recorded
message sent again: :class:`~pdserve.kv_transfer.wire.Sessions`), is refused the same
way (kind ``replayed``), before it is acted upon.

Reads are bound to their lease's prompt and first reader (:class:`LeaseTable`): a read
names the digest of decode's prompt and decode's engine id.

Bounds on authenticated peers (``kv_connector_extra_config``, see ``KVTransferConfig``):
reads per lease (in :class:`LeaseTable`), reads per second per connection (a token
bucket per ROUTER identity) and request ids per heartbeat / done notice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.lease import LeaseTable, ReadRefused
from pdserve.kv_transfer.transports.base import ServerTransport

logger = logging.getLogger(__name__)

_MAX_BUCKETS = 1024  # peer identities remembered before idle ones are forgotten
_BUCKET_IDLE_S = 60.0
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ServerLimits:
    max_ids_per_message: int = 1024
    max_reads_per_second: float = 1000.0


class _TokenBucket:
    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.tokens = max(rate, 1.0)
        self.at = now

    def take(self, now: float) -> bool:
        self.tokens = min(max(self.rate, 1.0), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class KVRequestHandler:
    def __init__(
        self,
        secret: bytes,
        engine_id: str,
        compat: dict[str, Any],
        transport: ServerTransport,
        leases: LeaseTable,
        limits: ServerLimits,
    ) -> None:
        self.secret = secret
        self.engine_id = engine_id
        self.compat = compat
        self.transport = transport
        self.leases = leases
        self.limits = limits
        self._buckets: dict[bytes, _TokenBucket] = {}
        self._lock = threading.Lock()  # the counters are read from the engine's thread
        self._rejected: dict[str, int] = {
            "unauthenticated": 0,
            "malformed": 0,
            "limit": 0,
            "replayed": 0,
        }
        self.sessions = W.Sessions()
        self._logged_at: dict[str, float] = {}

    @property
    def rejected(self) -> dict[str, int]:
        """Messages refused since start, by kind (unauthenticated, malformed, limit,
        replayed)."""
        with self._lock:
            return dict(self._rejected)

    def handle_frames(self, frames: list[bytes]) -> list[Any]:
        """The reply frames (identity first) for one received message; ``[]`` when there
        is no one to answer (a message without even an identity frame)."""
        if not frames:
            return []
        ident, body = frames[0], frames[1:]
        try:
            tag, session, counter, msg = W.open_request(self.secret, body)
        except W.Refused as e:
            self._count(e.kind, str(e))
            return [ident, *W.unsigned_error(str(e))]
        if isinstance(msg, W.Handshake):
            session = self.sessions.open()
        else:
            try:
                self.sessions.accept(session, counter)
            except W.Replayed as e:  # authentic, but not new: answered, never acted upon
                self._count(e.kind, str(e))
                return [ident, *W.seal_reply(self.secret, tag, W.Error(str(e)))]
        try:
            reply, bulk = self._handle(ident, msg, session)
        except Exception as e:  # a bug or a transport failure answers, never kills the server
            logger.exception("KV server: %s failed", type(msg).__name__)
            reply, bulk = W.Error(f"{type(e).__name__}: {e}"), []
        return [ident, *W.seal_reply(self.secret, tag, reply), *bulk]

    # -- authenticated messages -------------------------------------------------------------
    def _handle(
        self, peer: bytes, msg: W.ToServer, session: bytes
    ) -> tuple[W.FromServer, list[Any]]:
        if isinstance(msg, W.Handshake):
            return W.HandshakeReply(
                self.engine_id, self.compat, self.transport.transport_info(), session
            ), []
        if isinstance(msg, W.Heartbeat | W.Done):
            n, most = len(msg.request_ids), self.limits.max_ids_per_message
            if n > most:
                return self._refuse(
                    f"a {type(msg).__name__.lower()} of {n} request ids (at most {most} per "
                    "message: max_ids_per_message)"
                )
            if isinstance(msg, W.Heartbeat):
                self.leases.renew(msg.request_ids)  # renews only leases that exist
                return W.Ack(), []
            digests = msg.prompt_digests
            for i, rid in enumerate(msg.request_ids):
                digest = digests[i] if i < len(digests) else ""
                try:
                    self.leases.finish(rid, digest, msg.consumer)
                except ReadRefused as e:  # another prompt's or consumer's: left held
                    self._count("limit", f"a done notice refused: {e}")
            return W.Ack(), []
        if isinstance(msg, W.Read):
            return self._read(peer, msg)
        return W.Error(f"unexpected message {type(msg).__name__}"), []

    def _read(self, peer: bytes, msg: W.Read) -> tuple[W.FromServer, list[Any]]:
        rid = msg.request_id
        if (
            msg.first_block < 0
            or msg.num_read < 0
            or msg.first_block + msg.num_read > max(msg.num_blocks, 0)
        ):
            return W.Error(
                f"request {rid!r}: a read of blocks {msg.first_block}..+{msg.num_read} "
                f"of {msg.num_blocks}"
            ), []
        if not self._take_read_token(peer):
            return self._refuse(
                f"too many reads from this connection (max_reads_per_second "
                f"{self.limits.max_reads_per_second:g})"
            )
        try:
            held = self.leases.begin_read(rid, msg.prompt_digest, msg.consumer)
        except ReadRefused as e:
            return self._refuse(str(e))
        if held is None:
            return W.Error(
                f"prefill no longer holds the KV of request {rid!r} "
                "(its lease expired or it was released)"
            ), []
        try:
            if len(held) != msg.num_blocks:
                return W.Error(
                    f"request {rid!r}: prefill holds {len(held)} blocks, decode expects "
                    f"{msg.num_blocks} (do both instances tokenize the prompt the same way?)"
                ), []
            ids = held[msg.first_block : msg.first_block + msg.num_read]
            frames = self.transport.read(ids) if ids else []
            return W.ReadReply(ids, len(frames)), frames
        finally:
            self.leases.end_read(rid)

    def _take_read_token(self, peer: bytes) -> bool:
        now = time.monotonic()
        bucket = self._buckets.get(peer)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                idle = [k for k, b in self._buckets.items() if now - b.at > _BUCKET_IDLE_S]
                for k in idle or list(self._buckets)[: _MAX_BUCKETS // 2]:
                    del self._buckets[k]
            bucket = self._buckets[peer] = _TokenBucket(self.limits.max_reads_per_second, now)
        return bucket.take(now)

    def _refuse(self, why: str) -> tuple[W.FromServer, list[Any]]:
        self._count("limit", why)
        return W.Error(why), []

    def _count(self, kind: str, why: str) -> None:
        """Count a refusal; log the first of each kind and then at most one per 10 s."""
        now = time.monotonic()
        with self._lock:
            self._rejected[kind] = self._rejected.get(kind, 0) + 1
            total = self._rejected[kind]
            if now - self._logged_at.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._logged_at[kind] = now
        logger.warning("KV server refused a message, %s (%d so far): %s", kind, total, why)
