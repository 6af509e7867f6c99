"""What the two halves of a KV connector tell each other once per step (typed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core_types.kv_transfer_params import KVTransferParams

# how a request's error begins when its prompt's KV could not be loaded from prefill
# (its lease was gone, the prefill instance died, the read was refused): the API server
# answers it 503, naming the cause, rather than 500
KV_LOAD_FAILED = "the prompt's KV could not be loaded from its prefill instance"


@dataclass(frozen=True)
class KVPeer:
    """A prefill engine's KV server, as decode dials it."""

    host: str
    port: int
    engine_id: str | None = None

    @classmethod
    def of(cls, params: KVTransferParams) -> KVPeer:
        assert params.remote_host is not None and params.remote_port is not None
        return cls(params.remote_host, params.remote_port, params.remote_engine_id)


@dataclass(frozen=True)
class KVLoad:
    """Pull ``remote_request_id``'s blocks ``first_block ..`` into ``local_block_ids``."""

    request_id: str  # the local request
    peer: KVPeer
    remote_request_id: str
    local_block_ids: list[int]
    first_block: int  # blocks before this one decode has from its own prefix cache
    num_blocks: int  # blocks prefill holds for the request in all (consistency check)
    prompt_digest: str = ""  # of the local prompt: prefill serves KV computed for it only
    # prefill's ids of all ``num_blocks`` blocks, as its kv_transfer_params named them (a
    # transport that reads prefill's memory itself starts copying before the read's
    # reply); empty when unknown
    remote_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVNotice:
    """Request ids to renew (heartbeat) or release (done) at one prefill engine; a done
    notice names the digest of each request's local prompt (prefill frees only a lease
    whose prompt it is: a decode given another prompt's params cannot free that KV)."""

    peer: KVPeer
    request_ids: list[str]
    prompt_digests: list[str] = field(default_factory=list)  # done notices: one per id


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step."""

    loads: list[KVLoad] = field(default_factory=list)
    cancels: list[KVNotice] = field(default_factory=list)  # aborted before pulling
    heartbeats: list[KVNotice] = field(default_factory=list)  # lease renewals


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler side, once per step (every set drained by its reader)."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> reason
    transfer_seconds: list[float] = field(default_factory=list)
    transfer_bytes: list[int] = field(default_factory=list)
