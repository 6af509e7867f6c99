"""The servers' listening sockets give accepted connections TCP_NODELAY (asyncio only sets
it when the socket's proto is TCP; without it a kept-alive connection's first streamed
chunk waited ~40 ms for a delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

from pdserve.serving.net import bind_tcp


def test_bound_socket_is_tcp_and_loopback() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockname()[0] == "127.0.0.1"
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    finally:
        sock.close()


def test_accepted_connections_have_nodelay() -> None:
    async def run() -> int:
        sock = bind_tcp("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s = writer.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_conn, sock=sock)
        port = sock.getsockname()[1]
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 5)
            w.close()
        return value

    assert asyncio.run(run()) != 0
