"""KV transports: how block contents get from the prefill instance to the decode instance.

Each is a small plug-in with two halves. The server half runs in the prefill's KV
server thread and answers a read of held blocks; the client half runs in the decode's
transfer thread and writes what it got into local blocks. The control messages
(handshake, read, done, heartbeat) always travel over the ZMQ side channel.
"""

from __future__ import annotations

from pdserve.kv_transfer.transports.base import ClientTransport, ServerTransport


def make_transport(name: str) -> tuple[type[ServerTransport], type[ClientTransport]]:
    if name == "tcp":
        from pdserve.kv_transfer.transports.tcp import TcpClient, TcpServer

        return TcpServer, TcpClient
    if name == "cuda_ipc":
        from pdserve.kv_transfer.transports.cuda_ipc import CudaIpcClient, CudaIpcServer

        return CudaIpcServer, CudaIpcClient
    raise ValueError(f"unknown KV transport {name!r} (tcp | cuda_ipc)")
