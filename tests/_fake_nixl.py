"""A stand-in for NIXL's ``nixl_agent`` (the subset the nixl transport calls) over host
memory: agents made from one :class:`FakeFabric` know each other by metadata; a READ
checks that every descriptor lies inside memory its agent registered, then copies the
bytes (ctypes.memmove) when it is polled to completion. Every call is logged in
``fabric.calls`` as (agent name, method) so tests can check counts and order."""

from __future__ import annotations

import ctypes
import json
import threading
from functools import partial
from typing import Any

import numpy as np
import torch


class FakeConfig:
    def __init__(self, backends: list[str]) -> None:
        self.backends = backends


class FakeFabric:
    """``fail``: None, "post" (``transfer`` answers ERR), "transfer" (a poll answers
    ERR) or "stuck" (never completes). ``polls``: polls until a READ completes."""

    def __init__(self, fail: str | None = None, polls: int = 3) -> None:
        self.fail = fail
        self.polls = polls
        self.gate = threading.Event()  # READs complete only once it is set
        self.gate.set()
        self.agents: dict[str, FakeAgent] = {}
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def api(self) -> tuple[Any, type[FakeConfig]]:
        return partial(FakeAgent, self), FakeConfig

    def log(self, who: str, what: str) -> None:
        with self.lock:
            self.calls.append((who, what))

    def count(self, what: str) -> int:
        with self.lock:
            return sum(1 for _, w in self.calls if w == what)


class FakeAgent:
    def __init__(self, fabric: FakeFabric, name: str, config: FakeConfig) -> None:
        # ["UCX"]: NIXL's single worker; []: the backend comes from create_backend
        assert config.backends in (["UCX"], [])
        self.fabric, self.name = fabric, name
        self.backend_params: dict[str, dict[str, str]] = {"UCX": {}} if config.backends else {}
        self.regions: list[tuple[int, int]] = []
        self.remotes: set[str] = set()
        self.live: dict[int, dict[str, Any]] = {}
        self._next = 0
        fabric.agents[name] = self

    def create_backend(self, backend: str, params: dict[str, str]) -> None:
        self.fabric.log(self.name, "create_backend")
        assert backend == "UCX" and not self.backend_params, (backend, self.backend_params)
        assert all(isinstance(v, str) for v in params.values())  # NIXL takes strings only
        self.backend_params[backend] = dict(params)

    def register_memory(self, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        self.fabric.log(self.name, "register_memory")
        assert self.backend_params, "register_memory before any backend exists"
        self.regions = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        return list(self.regions)

    def deregister_memory(self, regions: list[tuple[int, int]]) -> None:
        self.fabric.log(self.name, "deregister_memory")
        assert regions == self.regions
        self.regions = []

    def get_agent_metadata(self) -> bytes:
        return json.dumps({"name": self.name}).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.fabric.log(self.name, "add_remote_agent")
        name = json.loads(metadata)["name"]
        self.remotes.add(name)
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        self.fabric.log(self.name, "remove_remote_agent")
        self.remotes.discard(name)

    def get_xfer_descs(self, descs: np.ndarray, mem_type: str) -> tuple[str, np.ndarray]:
        assert descs.dtype == np.uint64 and descs.ndim == 2 and descs.shape[1] == 3
        return mem_type, descs.copy()

    def initialize_xfer(
        self, op: str, local: tuple[str, np.ndarray], remote: tuple[str, np.ndarray], peer: str
    ) -> int:
        self.fabric.log(self.name, "initialize_xfer")
        assert op == "READ" and peer in self.remotes, (op, peer)
        assert local[1].shape == remote[1].shape
        assert (local[1][:, 1] == remote[1][:, 1]).all()  # equal lengths, row by row
        self._next += 1
        self.live[self._next] = {"local": local[1], "remote": remote[1], "peer": peer, "polls": 0}
        return self._next

    def transfer(self, handle: int) -> str:
        self.fabric.log(self.name, "transfer")
        return "ERR" if self.fabric.fail == "post" else "PROC"

    def check_xfer_state(self, handle: int) -> str:
        x = self.live[handle]
        x["polls"] += 1
        if self.fabric.fail == "transfer":
            return "ERR"
        if self.fabric.fail == "stuck" or x["polls"] < self.fabric.polls:
            return "PROC"
        if not self.fabric.gate.is_set():
            x["polls"] -= 1
            return "PROC"
        if x["polls"] == self.fabric.polls:
            far = self.fabric.agents[x["peer"]]
            for (dst, n, _), (src, _, _) in zip(x["local"], x["remote"], strict=True):
                _inside(self.regions, int(dst), int(n))
                _inside(far.regions, int(src), int(n))
                ctypes.memmove(int(dst), int(src), int(n))
            self.fabric.log(self.name, "read_complete")
        return "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        self.fabric.log(self.name, "release_xfer_handle")
        del self.live[handle]


def _inside(regions: list[tuple[int, int]], addr: int, n: int) -> None:
    assert any(a <= addr and addr + n <= a + size for a, size in regions), (
        f"[{addr:#x}, +{n}) lies outside the registered memory"
    )
