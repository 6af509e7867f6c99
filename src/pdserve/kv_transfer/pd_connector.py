"""``PdConnector``: pdserve's pull-based P/D connector (lease + heartbeat, pluggable transport).

Both halves share one ``LeaseTable`` (prefill side) and one ``KVPuller`` (decode side);
see the package docstring for the request lifecycle.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import KVTransferConfig
from pdserve.core_types.kv_connector import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVNotice,
    KVPeer,
)
from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.pd_auth import SECRET_ENV, load_secret, prompt_digest
from pdserve.core_types.utils import cdiv
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVHealth,
)
from pdserve.kv_transfer.handler import KVRequestHandler, ServerLimits
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.puller import KVPuller
from pdserve.kv_transfer.server import KVServer, advertised_host
from pdserve.kv_transfer.supervisor import Supervisor
from pdserve.kv_transfer.transports import Transport, open_transport
from pdserve.kv_transfer.transports.base import Fence

logger = logging.getLogger(__name__)


def wants_remote_prefill(req: ConnectorRequest) -> bool:
    p = req.kv_transfer_params
    return p is not None and p.do_remote_prefill


def wants_remote_decode(req: ConnectorRequest) -> bool:
    p = req.kv_transfer_params
    return p is not None and p.do_remote_decode


def require_secret() -> bytes:
    """The topology's P/D secret from the environment, or a RuntimeError saying how to
    give one (a P/D role never runs its KV side channel unauthenticated)."""
    try:
        secret = load_secret()
    except ValueError as e:
        raise RuntimeError(f"--kv-transfer-config: {e}") from None
    if secret is None:
        raise RuntimeError(
            f"--kv-transfer-config needs the topology's P/D secret in the environment "
            f"variable {SECRET_ENV} (it authenticates the KV side channel and the proxy's "
            f"kv_transfer_params): pdserve launch sets one; for a hand-made topology give "
            f"every instance and the proxy the same value, e.g. from "
            f"python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return secret


@dataclass
class _Shared:
    """State both halves see: identity, secret, leases, the server and the puller."""

    config: KVTransferConfig
    engine_id: str
    leases: LeaseTable
    secret: bytes
    server: KVServer | None = None
    advertise_host: str | None = None  # what kv_transfer_params name as remote_host
    puller: KVPuller | None = None


class PdConnectorScheduler(KVConnectorScheduler):
    def __init__(self, shared: _Shared, block_size: int) -> None:
        self.s = shared
        self.cfg = shared.config
        self.block_size = block_size
        # queued remote-prefill requests (heartbeats): id -> its prefill's params
        self._remote: dict[str, KVTransferParams] = {}
        self._pending: dict[str, KVLoad] = {}  # to load next step
        self._loading: set[str] = set()
        self._abandoned: set[str] = set()  # finished while their load was in flight
        self._cancels: list[KVNotice] = []
        self._last_heartbeat = 0.0
        self._freeable: list[str] = []
        self.num_failed_transfers = 0

    # -- decode side ------------------------------------------------------------------------
    def on_new_request(self, req: ConnectorRequest) -> None:
        p = req.kv_transfer_params
        if p is None or not (self.cfg.is_consumer and p.do_remote_prefill):
            return
        self._remote[req.request_id] = p  # its remote_* fields were checked at the edge

    def get_num_new_matched_tokens(
        self, req: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if req.request_id not in self._remote or req.request_id in self._loading:
            return 0, False
        # everything but the last prompt token, which decode computes to get its logits
        return max(0, req.num_prompt_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(
        self, req: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        p = self._remote[req.request_id]
        first = req.num_computed_tokens // self.block_size  # local prefix hits are whole blocks
        last = cdiv(req.num_computed_tokens + num_external_tokens, self.block_size)
        held = cdiv(req.num_prompt_tokens, self.block_size)
        sent = len(p.remote_block_ids or [])
        if sent != held:
            logger.warning(
                "request %s: prefill sent %d block ids for a %d-token prompt (%d expected)",
                req.request_id,
                sent,
                req.num_prompt_tokens,
                held,
            )
        assert p.remote_request_id is not None
        self._pending[req.request_id] = KVLoad(
            req.request_id,
            KVPeer.of(p),
            p.remote_request_id,
            block_ids[first:last],
            first,
            held,
            prompt_digest(req.prompt_token_ids),
            tuple(p.remote_block_ids or ()) if sent == held else (),
        )

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=list(self._pending.values()))
        self._loading.update(self._pending)
        self._pending = {}
        meta.cancels, self._cancels = self._cancels, []
        now = time.monotonic()
        if self._remote and now - self._last_heartbeat >= self.cfg.lease_seconds / 6:
            self._last_heartbeat = now
            groups: dict[KVPeer, list[str]] = {}
            for p in self._remote.values():
                assert p.remote_request_id is not None
                groups.setdefault(KVPeer.of(p), []).append(p.remote_request_id)
            meta.heartbeats = [KVNotice(peer, ids) for peer, ids in groups.items()]
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in [*out.finished_recving, *out.failed_recving]:
            self._loading.discard(rid)
            self._remote.pop(rid, None)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self._freeable.append(rid)
        self.num_failed_transfers += len(out.failed_recving)

    def give_up(self, req: ConnectorRequest) -> None:
        """Decode will not read this request's KV (load failed, or recompute instead)."""
        self._remote.pop(req.request_id, None)
        self._cancel(req)

    def _cancel(self, req: ConnectorRequest) -> None:
        p = req.kv_transfer_params
        if p is not None and p.do_remote_prefill and p.remote_request_id is not None:
            digest = prompt_digest(req.prompt_token_ids)
            self._cancels.append(KVNotice(KVPeer.of(p), [p.remote_request_id], [digest]))

    # -- both sides -------------------------------------------------------------------------
    def request_finished(
        self, req: ConnectorRequest, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        rid = req.request_id
        if rid in self._remote:  # decode side, KV not (fully) pulled
            self._remote.pop(rid)
            self._pending.pop(rid, None)
            if rid in self._loading:  # a pull is writing into our blocks: free after it stops
                self._abandoned.add(rid)
                return True, None
            self._cancel(req)
            return False, None
        ok = req.finished_normally
        if not (self.cfg.is_producer and wants_remote_decode(req) and ok and block_ids):
            return False, None
        srv = self.s.server
        assert srv is not None
        # the prompt's blocks only: lookahead slots past it (MTP drafting) hold no prompt
        # KV (they are freed with the rest when the lease ends)
        prompt_blocks = block_ids[: cdiv(req.num_prompt_tokens, self.block_size)]
        digest = prompt_digest(req.prompt_token_ids)
        self.s.leases.add(rid, prompt_blocks, digest)
        return True, KVTransferParams(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.s.engine_id,
            remote_block_ids=list(prompt_blocks),
            remote_request_id=rid,
            remote_host=self.s.advertise_host or srv.host,
            remote_port=srv.port,
            tp_size=1,
            remote_num_tokens=req.num_prompt_tokens,
            remote_lease_seconds=self.cfg.lease_seconds,
            remote_prompt_digest=digest,
        )

    def take_freeable(self) -> list[str]:
        out, self._freeable = self._freeable, []
        return out + self.s.leases.take_done() + self.s.leases.take_expired()

    def release(self, request_id: str) -> bool:
        return self.s.leases.finish(request_id)

    @property
    def num_held(self) -> int:
        return len(self.s.leases)

    @property
    def num_expired(self) -> int:
        return self.s.leases.num_expired


class PdConnectorWorker(KVConnectorWorker):
    def __init__(self, shared: _Shared, compat: dict[str, Any]) -> None:
        self.s = shared
        self.compat = compat
        self.supervisor = Supervisor(None, None)
        self.transport: Transport | None = None
        self.device = torch.device("cpu")  # the KV cache's

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        self.device = kv_caches.device
        cfg = self.s.config
        extra = cfg.kv_connector_extra_config
        transfer_timeout = float(extra.get("transfer_timeout", 60.0))
        transport = self.transport = open_transport(
            cfg.transport, kv_caches, transfer_timeout=transfer_timeout,
            nixl_threads=cfg.nixl_threads,
        )  # fmt: skip
        if cfg.is_producer:
            handler = KVRequestHandler(
                self.s.secret,
                self.s.engine_id,
                self.compat,
                transport.server(),
                self.s.leases,
                ServerLimits(cfg.max_ids_per_message, cfg.max_reads_per_second),
            )
            self.s.server = KVServer(
                handler, str(extra.get("host", "127.0.0.1")), int(extra.get("port", 0))
            )
            self.s.advertise_host = advertised_host(self.s.server.host, extra.get("advertise_host"))
            logger.info(
                "KV server for engine %s on %s:%d (%s), advertised as %s",
                self.s.engine_id,
                self.s.server.host,
                self.s.server.port,
                cfg.transport,
                self.s.advertise_host,
            )
        if cfg.is_consumer:
            self.s.puller = KVPuller(
                self.compat,
                transport.client,
                float(extra.get("handshake_timeout", 5.0)),
                transfer_timeout,
                self.s.secret,
                max_ids_per_message=cfg.max_ids_per_message,
                allowed=cfg.allowed_prefill,
                max_peers=cfg.max_prefill_peers,
                consumer=self.s.engine_id,
            )
        self.supervisor = Supervisor(self.s.server, self.s.puller)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        puller = self.s.puller
        if puller is None:
            return
        for notice in meta.heartbeats:
            puller.heartbeat(notice)
        for notice in meta.cancels:
            puller.notify_done(notice)
        fence = self._fence() if meta.loads else None
        for load in meta.loads:
            puller.load(load, fence)

    def _fence(self) -> Fence | None:
        """What this step's loads must not overtake: the engine's work launched so far
        (an event on the calling thread's current stream). Under async scheduling the
        step in flight still writes one KV slot into the last block of requests that
        finished (or were aborted or preempted) while it ran, and the scheduler may
        have given those freed blocks to these loads. None on a CPU cache."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.s.puller is None:
            return out
        for r in self.s.puller.take_results():
            if r.error is None:
                out.finished_recving.add(r.request_id)
                out.transfer_seconds.append(r.seconds)
                out.transfer_bytes.append(r.nbytes)
            else:
                out.failed_recving[r.request_id] = r.error
        return out

    def supervise(self) -> KVHealth:
        return self.supervisor.check()

    def shutdown(self) -> None:
        if self.s.server is not None:
            self.s.server.close()
        if self.s.puller is not None:
            self.s.puller.close()
        if self.transport is not None:
            self.transport.close()


def make_pd_connector(
    config: KVTransferConfig,
    block_size: int,
    compat: dict[str, Any],
    secret: bytes | None = None,
) -> tuple[PdConnectorScheduler, PdConnectorWorker]:
    """Both halves; ``secret`` defaults to the environment's (:func:`require_secret`)."""
    leases = LeaseTable(config.lease_seconds, config.max_reads_per_lease)
    secret = require_secret() if secret is None else secret
    shared = _Shared(config, uuid.uuid4().hex[:12], leases, secret)
    return PdConnectorScheduler(shared, block_size), PdConnectorWorker(shared, compat)
