"""The two-role KV connector contract (see the package docstring for the lifecycle)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.request import Request

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
CONNECTORS = ("PdConnector",)
TRANSPORTS = ("tcp", "cuda_ipc")

# the per-request fields, named as vLLM names them
PARAM_FIELDS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_block_ids",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
)


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config`` as in vLLM: connector, role and connector-specific extras.

    Extras understood by ``PdConnector`` (``kv_connector_extra_config``):
    ``transport`` (tcp | cuda_ipc), ``host`` and ``port`` of this instance's KV server
    (default 127.0.0.1 and an ephemeral port), ``lease_seconds`` (initial lease on
    prefill-held blocks, default 30), ``handshake_timeout`` (s, default 5),
    ``transfer_timeout`` (s, default 60).
    """

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not supported "
                f"(supported: {', '.join(CONNECTORS)})"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                "--kv-transfer-config: kv_load_failure_policy must be fail or recompute"
            )
        extra = self.kv_connector_extra_config
        known = {
            "transport",
            "host",
            "port",
            "lease_seconds",
            "handshake_timeout",
            "transfer_timeout",
        }
        unknown = set(extra) - known
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unknown kv_connector_extra_config key(s) "
                f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"--kv-transfer-config: transport must be one of {', '.join(TRANSPORTS)}"
            )
        if self.lease_seconds <= 0:
            raise ValueError("--kv-transfer-config: lease_seconds must be > 0")

    @classmethod
    def from_json(cls, value: str | dict | None) -> KVTransferConfig | None:
        if value is None:
            return None
        if isinstance(value, str):
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
        else:
            obj = dict(value)
        if not isinstance(obj, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy"}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unknown key(s) {', '.join(sorted(unknown))} "
                f"(known: {', '.join(sorted(known))})"
            )
        for req in ("kv_connector", "kv_role"):
            if req not in obj:
                raise ValueError(f"--kv-transfer-config needs {req!r}")
        obj.setdefault("kv_connector_extra_config", {})
        return cls(**obj)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transport(self) -> str:
        return str(self.kv_connector_extra_config.get("transport", "tcp"))

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_seconds", 30.0))


@dataclass
class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step."""

    # request id -> what to pull: (params from prefill, local block ids to fill,
    # index of the first remote block to read, blocks prefill holds in all)
    loads: dict[str, tuple[dict, list[int], int, int]] = field(default_factory=dict)
    # prefill engines to tell "I will not read this request" (aborted before pulling)
    cancels: list[tuple[dict, str]] = field(default_factory=list)
    # (params, request ids) to renew leases for, grouped per prefill engine
    heartbeats: list[tuple[dict, list[str]]] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler side, once per step (every set drained by its reader)."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> reason
    finished_sending: set[str] = field(default_factory=set)  # prefill: blocks may be freed
    transfer_seconds: list[float] = field(default_factory=list)
    transfer_bytes: list[int] = field(default_factory=list)


class KVConnectorScheduler(ABC):
    """Scheduler-side half. Called only from the scheduler's thread."""

    @abstractmethod
    def on_new_request(self, req: Request) -> None:
        """A request was queued (decode: start renewing its prefill lease now)."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, req: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that can come from the remote side, and
        whether they arrive asynchronously. No side effects; may be called repeatedly."""

    @abstractmethod
    def update_state_after_alloc(
        self, req: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks for the external tokens are allocated; record what to load into them."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's work for the worker side; resets the per-step state."""

    @abstractmethod
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Once per request, before its blocks are freed: (delay_free, kv_transfer_params).

        ``delay_free`` True means the connector owns freeing the blocks until the request
        id appears in a later ``KVConnectorOutput.finished_sending``."""

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """Feedback from the worker side for this step."""

    @abstractmethod
    def take_freeable(self) -> list[str]:
        """Requests whose delayed blocks may be freed now: prefill-held ones that decode
        finished reading or gave up, whose lease expired or that were released, and
        decode-side ones whose interrupted pull has stopped writing."""

    @abstractmethod
    def give_up(self, req: Request) -> None:
        """Decode will never read this request's remote KV (its load failed)."""

    def release(self, request_id: str) -> bool:
        """Free a prefill-held request's blocks on request (the proxy gave it up)."""
        return False

    @property
    def num_held(self) -> int:
        """Requests whose blocks are held for a remote decode."""
        return 0

    @property
    def num_expired(self) -> int:
        """Leases that ran out (cumulative)."""
        return 0

    def shutdown(self) -> None:  # noqa: B027
        """Stop background threads and sockets."""


class KVConnectorWorker(ABC):
    """Worker-side half: owns the transport and touches the KV cache tensors."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[Any]) -> None: ...

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start pulling this step's loads (asynchronous; results via ``get_finished``)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Everything that completed since the last call."""

    def shutdown(self) -> None:  # noqa: B027
        """Stop background threads and sockets."""
