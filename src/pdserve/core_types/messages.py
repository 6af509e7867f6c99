"""Every message between the API server and the engine-core process, as typed structs.

Encoded with msgspec (msgpack) as a tagged union: the receiver decodes straight into
one of these classes; nothing is pickled and no method names travel.

:class:`EngineCoreRequest` is the one typed request: the frontend's input processor
validates a user's request once and builds it; the engine core's ``Request`` is made
from it and from nothing else.
"""

from __future__ import annotations

import msgspec

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.sampling_params import SamplingParams
from pdserve.core_types.scheduler_output import EngineCoreOutput
from pdserve.core_types.stats import SchedulerStats


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_output_tokens: int  # absolute cap on output tokens (max_tokens or the room left)
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    # "abort" (client went away) or "stop" (a stop string matched in the frontend)
    reason: str = "abort"


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    pass


class ReleaseKV(msgspec.Struct, tag="release_kv"):
    """Prefill side: free the blocks held for a remote decode of this request now."""

    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Wake(msgspec.Struct, tag="wake"):
    """Expert parallelism: sent to every DP rank after each message to one of them, with
    an increasing ``seq``, so idle ranks join the next step agreement promptly
    (:mod:`pdserve.distributed.dp_sync`)."""

    seq: int


class EngineReady(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    device: str
    startup_seconds: float
    speculative: bool = False  # bad_words are refused with speculative decoding
    priority_scheduling: bool = False  # --scheduling-policy priority: requests may set one
    dp_rank: int = 0
    lockstep: bool = False  # expert parallelism: the client sends Wake messages


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    dp_rank: int = 0


class EngineError(msgspec.Struct, tag="error"):
    message: str
    dp_rank: int = 0


ToEngine = EngineCoreRequest | AbortRequests | ResetPrefixCache | ReleaseKV | Shutdown | Wake
FromEngine = EngineReady | EngineOutputs | EngineError

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(msg: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(buf: bytes) -> ToEngine:
    return _to_engine.decode(buf)


def decode_from_engine(buf: bytes) -> FromEngine:
    return _from_engine.decode(buf)
