"""The two-role KV connector contract (see the package docstring for the lifecycle).

The connector sees a request through :class:`ConnectorRequest`, the few fields it
reads, never the engine's ``Request`` class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.core_types.kv_connector import KVConnectorMetadata, KVConnectorOutput
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.forward_context import KVCaches


class ConnectorRequest(Protocol):
    """What a connector may read of a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def kv_transfer_params(self) -> KVTransferParams | None: ...
    @property
    def finished_normally(self) -> bool:
        """Stopped or reached its length (not aborted, not failed)."""
        ...


class KVConnectorScheduler(ABC):
    """Scheduler-side half. Called only from the scheduler's thread."""

    @abstractmethod
    def on_new_request(self, req: ConnectorRequest) -> None:
        """A request was queued (decode: start renewing its prefill lease now)."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, req: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that can come from the remote side, and
        whether they arrive asynchronously. No side effects; may be called repeatedly."""

    @abstractmethod
    def update_state_after_alloc(
        self, req: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks for the external tokens are allocated; record what to load into them."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's work for the worker side; resets the per-step state."""

    @abstractmethod
    def request_finished(
        self, req: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        """Once per request, before its blocks are freed: (delay_free, kv_transfer_params).

        ``delay_free`` True means the connector owns freeing the blocks until the request
        id is returned by a later :meth:`take_freeable`."""

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """Feedback from the worker side for this step."""

    @abstractmethod
    def take_freeable(self) -> list[str]:
        """Requests whose delayed blocks may be freed now: prefill-held ones that decode
        finished reading or gave up, whose lease expired or that were released, and
        decode-side ones whose interrupted pull has stopped writing."""

    @abstractmethod
    def give_up(self, req: ConnectorRequest) -> None:
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


@dataclass
class KVHealth:
    """The worker half's background machinery, as the engine reports it."""

    healthy: bool = True
    reason: str = ""  # why not healthy (empty when healthy)
    restarts: int = 0  # threads restarted after they died, since start
    rejected: dict[str, int] = field(default_factory=dict)  # side-channel refusals by kind


class KVConnectorWorker(ABC):
    """Worker-side half: owns the transport and touches the KV cache tensors."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: KVCaches) -> None: ...

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start pulling this step's loads (asynchronous; results via ``get_finished``)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Everything that completed since the last call."""

    def supervise(self) -> KVHealth:
        """Check the background threads, restart dead ones (each when its back-off
        allows), and say how healthy the connector is. Called from the engine's thread."""
        return KVHealth()

    def shutdown(self) -> None:  # noqa: B027
        """Stop background threads and sockets."""
