"""Messages of the KV side channel between a decode instance and a prefill instance's
KV server, as typed msgspec structs (msgpack), and the authenticated envelope they
travel in.

Frames (decode's DEALER → prefill's ROUTER, which prepends the connection's identity):

- request: ``[tag, payload]``, ``tag = mac(secret, REQUEST_LABEL, payload)``;
- reply: ``[tag, payload, *bulk]``, ``tag = mac(secret, REPLY_LABEL, request_tag,
  payload)``: bound to the request it answers, so a reply cannot be replayed as the
  answer to another request, and a peer without the secret cannot pose as a prefill.
  ``bulk`` are the KV frames of a read (their count is in the authenticated payload;
  their bytes are not hashed: a MAC over every KV byte would cost more than the copy).

The receiver checks the tag before it decodes anything (:func:`open_request`,
:func:`open_reply`). A message that fails the check gets an *unsigned* ``Error`` reply
(signing replies to unauthenticated input would hand out tags for chosen data).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.core_types.pd_auth import SECRET_ENV, mac, mac_ok

REQUEST_LABEL = b"pdserve-kv-side-channel/request/v1"
REPLY_LABEL = b"pdserve-kv-side-channel/reply/v1"
NOT_AUTHENTICATED = "not authenticated"


class Handshake(msgspec.Struct, tag="handshake"):
    compat: dict[str, Any]


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    compat: dict[str, Any]
    transport_info: dict[str, Any] = {}


class Read(msgspec.Struct, tag="read"):
    request_id: str
    first_block: int  # skip blocks decode already has from its own prefix cache
    num_read: int  # blocks to read from first_block on
    num_blocks: int  # how many blocks decode expects prefill to hold in all (checked)


class ReadReply(msgspec.Struct, tag="read_reply"):
    block_ids: list[int]  # the prefill-side ids read (cuda_ipc: decode copies them itself)
    num_frames: int  # one per cache layer, in KVCaches.layers() order (0: decode copies)


class Done(msgspec.Struct, tag="done"):
    request_ids: list[str]  # read complete, or decode will never read them


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


def seal_request(secret: bytes, msg: ToServer) -> tuple[bytes, bytes]:
    """``(tag, payload)``: the frames of a request."""
    payload = encode(msg)
    return mac(secret, REQUEST_LABEL, payload), payload


def open_request(secret: bytes, frames: list[bytes]) -> tuple[bytes, ToServer]:
    """The request's tag and message, if a holder of ``secret`` sent it; else
    :class:`NotAuthenticated` or :class:`Malformed` (checked before any decoding)."""
    if len(frames) != 2:
        raise Malformed(f"expected 2 frames (mac, message), got {len(frames)}")
    tag, payload = frames
    if not mac_ok(secret, tag, REQUEST_LABEL, payload):
        raise NotAuthenticated(NOT_AUTHENTICATED)
    try:
        return tag, decode_to_server(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise Malformed(f"undecodable message: {e}") from None


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
