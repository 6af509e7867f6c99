"""Messages of the KV side channel between a decode instance and a prefill instance's
KV server, as typed msgspec structs (msgpack), and the authenticated envelope they
travel in.

Frames (decode's DEALER → prefill's ROUTER, which prepends the connection's identity):

- request: ``[tag, header, payload]``, ``header = session (16 bytes) + counter (8 bytes,
  little-endian)``, ``tag = mac(secret, REQUEST_LABEL, header, payload)``;
- reply: ``[tag, payload, *bulk]``, ``tag = mac(secret, REPLY_LABEL, request_tag,
  payload)``: bound to the request it answers, so a reply cannot be replayed as the
  answer to another request, and a peer without the secret cannot pose as a prefill.
  ``bulk`` are the KV frames of a read (their count is in the authenticated payload;
  their bytes are not hashed: a MAC over every KV byte would cost more than the copy).

Sessions (no replay): a connection starts with a ``Handshake`` (session all zeros,
counter 0, a fresh client nonce in the payload); the server answers with a fresh random
session id, and every later request of that connection carries it with a counter that
grows by one per request. The server keeps each session's last counter
(:class:`Sessions`) and refuses a request whose counter is not above it, or whose
session it does not know: a recorded request is never accepted twice, on any
connection. (A recorded handshake replayed opens a session its sender cannot use
without the secret.)

The receiver checks the tag before it decodes anything (:func:`open_request`,
:func:`open_reply`). A message that fails the check gets an *unsigned* ``Error`` reply
(signing replies to unauthenticated input would hand out tags for chosen data).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

import msgspec

from pdserve.core_types.pd_auth import SECRET_ENV, mac, mac_ok

REQUEST_LABEL = b"pdserve-kv-side-channel/request/v2"
REPLY_LABEL = b"pdserve-kv-side-channel/reply/v2"
NOT_AUTHENTICATED = "not authenticated"
SESSION_BYTES = 16
NO_SESSION = bytes(SESSION_BYTES)  # a handshake's
HEADER_BYTES = SESSION_BYTES + 8


class Handshake(msgspec.Struct, tag="handshake"):
    compat: dict[str, Any]
    nonce: bytes = b""  # the client's, fresh per handshake (its reply cannot be replayed)


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    compat: dict[str, Any]
    transport_info: dict[str, Any] = {}
    session: bytes = b""  # the connection's session id (its requests carry it)


class Read(msgspec.Struct, tag="read"):
    request_id: str
    first_block: int  # skip blocks decode already has from its own prefix cache
    num_read: int  # blocks to read from first_block on
    num_blocks: int  # how many blocks decode expects prefill to hold in all (checked)
    prompt_digest: str = ""  # of decode's prompt: prefill serves KV computed for it only
    consumer: str = ""  # decode's engine id: the first reader of a lease is its only one


class ReadReply(msgspec.Struct, tag="read_reply"):
    block_ids: list[int]  # the prefill-side ids read (cuda_ipc: decode copies them itself)
    num_frames: int  # one per cache layer, in KVCaches.layers() order (0: decode copies)


class Done(msgspec.Struct, tag="done"):
    request_ids: list[str]  # read complete, or decode will never read them
    prompt_digests: list[str] = []  # of decode's prompt, one per id (checked by prefill)
    consumer: str = ""  # decode's engine id (a lease read by another is not freed)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    request_ids: list[str]


class Ack(msgspec.Struct, tag="ack"):
    pass


class Error(msgspec.Struct, tag="error"):
    message: str


ToServer = Handshake | Read | Done | Heartbeat
FromServer = HandshakeReply | ReadReply | Ack | Error

_enc = msgspec.msgpack.Encoder()
_to_server = msgspec.msgpack.Decoder(ToServer)
_from_server = msgspec.msgpack.Decoder(FromServer)


def encode(msg: ToServer | FromServer) -> bytes:
    return _enc.encode(msg)


def decode_to_server(buf: bytes) -> ToServer:
    return _to_server.decode(buf)


def decode_from_server(buf: bytes) -> FromServer:
    return _from_server.decode(buf)


# -- the authenticated envelope ---------------------------------------------------------------
class Refused(Exception):
    """A message the receiver will not act upon; ``kind`` counts it."""

    kind = "malformed"


class Malformed(Refused):
    kind = "malformed"


class NotAuthenticated(Refused):
    kind = "unauthenticated"


def header(session: bytes, counter: int) -> bytes:
    """The header frame of a request: the session id and the request's counter."""
    return session + counter.to_bytes(8, "little")


def seal_request(
    secret: bytes, msg: ToServer, session: bytes = NO_SESSION, counter: int = 0
) -> tuple[bytes, bytes, bytes]:
    """``(tag, header, payload)``: the frames of a request (a handshake: no session)."""
    head = header(session, counter)
    payload = encode(msg)
    return mac(secret, REQUEST_LABEL, head, payload), head, payload


def open_request(secret: bytes, frames: list[bytes]) -> tuple[bytes, bytes, int, ToServer]:
    """The request's tag, session, counter and message, if a holder of ``secret`` sent
    it; else :class:`NotAuthenticated` or :class:`Malformed` (checked before any
    decoding). Whether the session and counter are acceptable is :class:`Sessions`'s."""
    if len(frames) != 3:
        raise Malformed(f"expected 3 frames (mac, header, message), got {len(frames)}")
    tag, head, payload = frames
    if not mac_ok(secret, tag, REQUEST_LABEL, head, payload):
        raise NotAuthenticated(NOT_AUTHENTICATED)
    if len(head) != HEADER_BYTES:
        raise Malformed(f"a header of {len(head)} bytes ({HEADER_BYTES} expected)")
    session, counter = head[:SESSION_BYTES], int.from_bytes(head[SESSION_BYTES:], "little")
    try:
        msg = decode_to_server(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise Malformed(f"undecodable message: {e}") from None
    if isinstance(msg, Handshake) != (session == NO_SESSION):
        raise Malformed("a handshake opens a session; every other message needs one")
    return tag, session, counter, msg


class Replayed(Refused):
    kind = "replayed"


class Sessions:
    """The server's sessions: id -> the last counter accepted (see the module
    docstring). At most ``max_sessions`` are kept; the least recently used is forgotten
    first (its peer then handshakes again). Used from the KV server's thread only."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def open(self) -> bytes:
        """A new session id (counters start above 0)."""
        sid = secrets.token_bytes(SESSION_BYTES)
        self._last[sid] = 0
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        return sid

    def accept(self, session: bytes, counter: int) -> None:
        """Take the request numbered ``counter`` of ``session``, or :class:`Replayed`."""
        last = self._last.get(session)
        if last is None:
            raise Replayed("unknown or expired side-channel session (handshake again)")
        if counter <= last:
            raise Replayed(
                f"a replayed side-channel message (counter {counter}, last accepted {last})"
            )
        self._last[session] = counter
        self._last.move_to_end(session)


def client_nonce() -> bytes:
    """A fresh nonce for a :class:`Handshake` (random, and distinct over time)."""
    return secrets.token_bytes(8) + time.monotonic_ns().to_bytes(8, "little")


def seal_reply(secret: bytes, request_tag: bytes, msg: FromServer) -> tuple[bytes, bytes]:
    payload = encode(msg)
    return mac(secret, REPLY_LABEL, request_tag, payload), payload


def unsigned_error(message: str) -> tuple[bytes, bytes]:
    """The frames answering a message that could not be authenticated (empty tag)."""
    return b"", encode(Error(message))


def open_reply(secret: bytes, request_tag: bytes, frames: list[Any]) -> tuple[FromServer, list]:
    """The reply to the request tagged ``request_tag`` and its bulk frames (``zmq.Frame``
    or bytes), if the prefill holds ``secret``; else :class:`NotAuthenticated` quoting
    any error the peer sent (unverified: it helps to diagnose a secret mismatch)."""
    raw = [f.bytes if hasattr(f, "bytes") else bytes(f) for f in frames[:2]]
    if len(raw) != 2:
        raise Malformed(f"a reply of {len(frames)} frame(s)")
    tag, payload = raw
    if not mac_ok(secret, tag, REPLY_LABEL, request_tag, payload):
        said = ""
        try:
            msg = decode_from_server(payload)
            if isinstance(msg, Error):
                said = f"; it said (unverified): {msg.message[:200]!r}"
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        raise NotAuthenticated(
            f"the prefill KV server's reply is not authenticated{said} (do both instances "
            f"share the topology's {SECRET_ENV}?)"
        )
    try:
        return decode_from_server(payload), list(frames[2:])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise Malformed(f"undecodable reply: {e}") from None
