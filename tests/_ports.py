"""Ports for servers a test starts: below the kernel's ephemeral range.

A port the kernel hands out for ``bind(0)`` is an ephemeral one, and between the test
closing its probe socket and the server binding it, any outgoing connection on the
machine may take it as its local port (the proxy soak, running beside the suite, opens
thousands). Ports picked below that range are never given to outgoing connections; each
is checked free by binding it, and a process draws from its own random sequence."""

from __future__ import annotations

import os
import random
import socket

_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now, outside the ephemeral range."""
    low, high = 10000, _ephemeral_low() - 1
    out: list[int] = []
    if high - low < 1000:  # an unusual range: fall back to the kernel's choice
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            return [int(s.getsockname()[1]) for s in socks]
        finally:
            for s in socks:
                s.close()
    for _ in range(100 * n):
        port = _rng.randint(low, high)
        if port not in out and _bindable(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError(f"no {n} free ports in {low}-{high}")


def free_port() -> int:
    return free_ports(1)[0]
