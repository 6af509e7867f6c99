"""KV transports: how block contents get from the prefill instance to the decode instance.

Each is a small plug-in with two halves. The server half runs in the prefill's KV
server thread and answers a read of held blocks; the client half runs in the decode's
transfer thread and writes what it got into local blocks (one client per handshaken
connection). The control messages (handshake, read, done, heartbeat) always travel
over the ZMQ side channel.

- ``tcp``: the blocks travel as ZMQ frames (staged through pinned host memory on a GPU).
- ``cuda_ipc``: decode maps prefill's cache tensors and copies on the device (one host).
- ``nixl``: decode READs the blocks with NIXL into its own (optional package).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.kv_transfer import DEFAULT_NIXL_THREADS
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.base import ClientTransport, ServerTransport

TRANSPORTS = ("tcp", "cuda_ipc", "nixl")


@dataclass
class Transport:
    """One instance's transport over its caches: what the KV server answers with, a
    client per handshake, and what to release at shutdown."""

    name: str
    server: Callable[[], ServerTransport]
    client: Callable[[dict[str, Any]], ClientTransport]
    close: Callable[[], None] = field(default=lambda: None)


def open_transport(
    name: str,
    kv_caches: KVCaches,
    *,
    transfer_timeout: float = 60.0,
    nixl_threads: int = DEFAULT_NIXL_THREADS,
) -> Transport:
    """Open transport ``name`` over ``kv_caches`` (nixl: its agent registers them now, with
    ``nixl_threads`` UCX worker threads, 0 for NIXL's single worker)."""
    if name == "tcp":
        from pdserve.kv_transfer.transports.tcp import TcpClient, TcpServer

        return Transport(name, lambda: TcpServer(kv_caches), lambda i: TcpClient(kv_caches, i))
    if name == "cuda_ipc":
        from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient, CudaIpcServer

        if kv_caches.device.type != "cuda":  # refused at start, not at the first handshake
            raise RuntimeError(
                f"the cuda_ipc KV transport needs the KV cache on a CUDA device (this "
                f"instance runs on {kv_caches.device}); use transport tcp or nixl"
            )
        return Transport(
            name, lambda: CudaIpcServer(kv_caches), lambda i: CudaIpcClient(kv_caches, i)
        )
    if name == "nixl":
        from pdserve.kv_transfer.transports.nixl import NixlClient, NixlEndpoint, NixlServer

        ep = NixlEndpoint(kv_caches, transfer_timeout=transfer_timeout, num_threads=nixl_threads)
        return Transport(
            name,
            lambda: NixlServer(kv_caches, ep),
            lambda i: NixlClient(kv_caches, i, ep),
            ep.close,
        )
    raise ValueError(f"unknown KV transport {name!r} ({' | '.join(TRANSPORTS)})")
