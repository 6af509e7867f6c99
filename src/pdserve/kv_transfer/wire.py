"""Messages of the KV side channel between a decode instance and a prefill instance's
KV server, as typed msgspec structs (msgpack). Bulk KV bytes travel as extra frames."""

from __future__ import annotations

from typing import Any

import msgspec


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
