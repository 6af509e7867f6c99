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

from pdserve.engine.kv_cache.manager import cdiv
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferConfig,
)
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.puller import KVPuller, LoadJob
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports import make_transport

logger = logging.getLogger(__name__)

_REMOTE_FIELDS = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port")


def wants_remote_prefill(req: Request) -> bool:
    p = req.kv_transfer_params
    return bool(p and p.get("do_remote_prefill"))


def wants_remote_decode(req: Request) -> bool:
    p = req.kv_transfer_params
    return bool(p and p.get("do_remote_decode"))


@dataclass
class _Shared:
    """State both halves see: identity, leases, the server address and the puller."""

    config: KVTransferConfig
    engine_id: str
    leases: LeaseTable
    server: KVServer | None = None
    puller: KVPuller | None = None


class PdConnectorScheduler(KVConnectorScheduler):
    def __init__(self, shared: _Shared, block_size: int) -> None:
        self.s = shared
        self.cfg = shared.config
        self.block_size = block_size
        self._remote: dict[str, Request] = {}  # queued remote-prefill requests (heartbeats)
        self._pending: dict[str, tuple[dict, list[int], int, int]] = {}  # to load next step
        self._loading: set[str] = set()
        self._abandoned: set[str] = set()  # finished while their load was in flight
        self._cancels: list[tuple[dict, str]] = []
        self._last_heartbeat = 0.0
        self._freeable: list[str] = []
        self.num_failed_transfers = 0

    # -- decode side ------------------------------------------------------------------------
    def on_new_request(self, req: Request) -> None:
        if not (self.cfg.is_consumer and wants_remote_prefill(req)):
            return
        p = req.kv_transfer_params or {}
        missing = [f for f in _REMOTE_FIELDS if p.get(f) is None]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill lack {', '.join(missing)}")
        self._remote[req.request_id] = req

    def get_num_new_matched_tokens(
        self, req: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if req.request_id not in self._remote or req.request_id in self._loading:
            return 0, False
        # everything but the last prompt token, which decode computes to get its logits
        return max(0, req.num_prompt_tokens - 1 - num_computed_tokens), True

    def update_state_after_alloc(
        self, req: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        p = req.kv_transfer_params or {}
        first = req.num_computed_tokens // self.block_size  # local prefix hits are whole blocks
        last = cdiv(req.num_computed_tokens + num_external_tokens, self.block_size)
        held = cdiv(req.num_prompt_tokens, self.block_size)
        if len(p.get("remote_block_ids") or []) != held:
            logger.warning(
                "request %s: prefill sent %d block ids for a %d-token prompt (%d expected)",
                req.request_id,
                len(p.get("remote_block_ids") or []),
                req.num_prompt_tokens,
                held,
            )
        self._pending[req.request_id] = (p, block_ids[first:last], first, held)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata()
        for rid, (p, local, first, held) in self._pending.items():
            meta.loads[rid] = (p, local, first, held)
            self._loading.add(rid)
        self._pending = {}
        meta.cancels, self._cancels = self._cancels, []
        now = time.monotonic()
        if self._remote and now - self._last_heartbeat >= self.cfg.lease_seconds / 6:
            self._last_heartbeat = now
            groups: dict[tuple[str, int], tuple[dict, list[str]]] = {}
            for req in self._remote.values():
                p = req.kv_transfer_params or {}
                key = (str(p["remote_host"]), int(p["remote_port"]))
                groups.setdefault(key, (p, []))[1].append(str(p["remote_request_id"]))
            meta.heartbeats = list(groups.values())
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in [*out.finished_recving, *out.failed_recving]:
            self._loading.discard(rid)
            self._remote.pop(rid, None)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self._freeable.append(rid)
        self.num_failed_transfers += len(out.failed_recving)

    def give_up(self, req: Request) -> None:
        """Decode will not read this request's KV (load failed, or recompute instead)."""
        self._remote.pop(req.request_id, None)
        if req.kv_transfer_params:
            self._cancels.append(
                (req.kv_transfer_params, str(req.kv_transfer_params["remote_request_id"]))
            )

    # -- both sides -------------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = req.request_id
        if rid in self._remote:  # decode side, KV not (fully) pulled
            self._remote.pop(rid)
            self._pending.pop(rid, None)
            if rid in self._loading:  # a pull is writing into our blocks: free after it stops
                self._abandoned.add(rid)
                return True, None
            p = req.kv_transfer_params or {}
            self._cancels.append((p, str(p["remote_request_id"])))
            return False, None
        ok = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not (self.cfg.is_producer and wants_remote_decode(req) and ok and block_ids):
            return False, None
        srv = self.s.server
        assert srv is not None
        self.s.leases.add(rid, block_ids)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.s.engine_id,
            "remote_block_ids": list(block_ids),
            "remote_request_id": rid,
            "remote_host": srv.host,
            "remote_port": srv.port,
            "tp_size": 1,
            "remote_num_tokens": req.num_prompt_tokens,
            "remote_lease_seconds": self.cfg.lease_seconds,
        }

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
        self._caches: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        cfg = self.s.config
        extra = cfg.kv_connector_extra_config
        self._caches = list(kv_caches)
        server_cls, client_cls = make_transport(cfg.transport)
        if cfg.is_producer:
            self.s.server = KVServer(
                self.s.engine_id,
                self.compat,
                server_cls(self._caches),
                self.s.leases,
                str(extra.get("host", "127.0.0.1")),
                int(extra.get("port", 0)),
            )
            logger.info(
                "KV server for engine %s on %s:%d (%s)",
                self.s.engine_id,
                self.s.server.host,
                self.s.server.port,
                cfg.transport,
            )
        if cfg.is_consumer:
            caches = self._caches
            self.s.puller = KVPuller(
                self.compat,
                lambda info: client_cls(caches, info),
                float(extra.get("handshake_timeout", 5.0)),
                float(extra.get("transfer_timeout", 60.0)),
            )

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        puller = self.s.puller
        if puller is None:
            return
        for p, rids in meta.heartbeats:
            puller.heartbeat(p, rids)
        for p, rid in meta.cancels:
            puller.notify_done(p, [rid])
        for rid, (p, local, first, held) in meta.loads.items():
            puller.load(LoadJob(rid, p, local, first, held))

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

    def shutdown(self) -> None:
        if self.s.server is not None:
            self.s.server.close()
        if self.s.puller is not None:
            self.s.puller.close()


def make_pd_connector(
    config: KVTransferConfig, block_size: int, compat: dict[str, Any]
) -> tuple[PdConnectorScheduler, PdConnectorWorker]:
    shared = _Shared(config, uuid.uuid4().hex[:12], LeaseTable(config.lease_seconds))
    return PdConnectorScheduler(shared, block_size), PdConnectorWorker(shared, compat)
