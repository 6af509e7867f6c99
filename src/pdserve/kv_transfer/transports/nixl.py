"""NIXL transport: decode READs the leased blocks straight out of prefill's registered
cache memory into its own blocks, with NIXL (UCX underneath: CUDA IPC or NVLink on one
host, RDMA across hosts, shared memory or TCP for host memory).

- **One agent per instance** (:class:`NixlEndpoint`, made when the connector registers
  the KV caches): it registers every cache tensor of every group, each with its own
  layout, once at start-up, and serves both roles of a ``kv_both`` instance.
- **Handshake.** Prefill's handshake reply (authenticated, on the side channel) carries
  its agent metadata, its cache segments (``block_copy.Segments``: address and bytes a
  block of every contiguous stretch) and the memory kind; decode checks the segments
  pair with its own and loads the metadata (``add_remote_agent``) once per prefill.
- **Read.** After prefill's read reply (which names the held blocks and pins the lease
  meanwhile) decode turns each run of blocks consecutive on both sides into one
  descriptor per segment, waits on the host for the load's fence (the engine's work
  issued before the load, which may still write into the blocks: a READ is ordered on
  no CUDA stream; ``transports.base``), posts one READ for all of them
  (``initialize_xfer`` + ``transfer``), polls ``check_xfer_state`` until it is done,
  fails or times out, and releases the request. Only then does the puller report the
  read and send the done notice (on the side channel, as for every transport); a
  failed read reports a transfer error instead, and the scheduler's give-up notice
  releases the lease.

Thread safety: an agent is driven from the KV server thread (the handshake payload,
made once) and every puller worker, so each call into it holds the endpoint's lock;
waiting for a READ holds it only for each poll.

NIXL is optional: it is imported when the transport is opened, and its absence fails
the instance at start with the package to install (``nixl-cu13`` for CUDA 13,
``nixl-cu12`` for CUDA 12). The side channel authenticates who learns the metadata;
NIXL's own connections are not authenticated beyond that (as with ``cuda_ipc``, a peer
holding the metadata can read any registered block).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import torch

from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.base import (
    ClientTransport,
    Fence,
    PendingWrite,
    ServerTransport,
    block_run_table,
)
from pdserve.kv_transfer.transports.block_copy import Segments, check_ids

logger = logging.getLogger(__name__)

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
# Decode READs prefill's blocks, and a READ is a UCX GET. On one host UCX's cuda_ipc
# transport turns GETs off where the GPU has no active NVLink ("auto": platforms where
# concurrent reads were slower than writes), and UCX then emulates the GET over TCP
# loopback through host memory: on the H100 of RESULTS.md run 103 (a single GPU, its
# NVLinks idle) a 16K llama-8b-shape prompt took 4.7 s against a 1.4 ms copy bound, the
# protocol table naming "remote memory read by ucp_get* ... software emulation | tcp/lo".
# pdserve turns cuda_ipc GETs on unless the environment already chose (UCX reads its
# environment when the agent's context is made).
UCX_ENV_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
_SPIN_POLLS = 200  # polls before the wait starts sleeping between them
_SPLIT_DESCS = 8  # with worker threads: READs of this many descriptors or more are split


def nixl_package() -> str:
    """The NIXL package matching this torch's CUDA (nixl-cu13 unless CUDA 12)."""
    cuda = torch.version.cuda or ""
    return "nixl-cu12" if cuda.startswith("12.") else "nixl-cu13"


def load_nixl() -> tuple[Any, Any]:
    """``(nixl_agent, nixl_agent_config)`` of whichever NIXL package is installed; a
    RuntimeError naming the package to install if none is."""
    why = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except (ImportError, OSError) as e:
            why.append(f"{name}: {e}")
            continue
        return mod.nixl_agent, mod.nixl_agent_config
    raise RuntimeError(
        f"the nixl KV transport needs NIXL's Python package: pip install {nixl_package()} "
        f"(nixl-cu13 for CUDA 13, nixl-cu12 for CUDA 12); none imports ({'; '.join(why)})"
    )


def read_descriptors(
    remote: Segments,
    local: Segments,
    remote_ids: list[int] | np.ndarray,
    local_ids: list[int] | np.ndarray,
    remote_device: int,
    local_device: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(remote, local)`` descriptor tables, [N, 3] uint64 rows of (address, bytes,
    device): one per run of blocks consecutive on both sides and segment, run-major."""
    runs = block_run_table(remote_ids, local_ids)
    r0, l0, n = runs[:, 0:1], runs[:, 1:2], runs[:, 2:3]
    size = local.block_bytes[None, :]
    length = (n * size).reshape(-1)

    def table(addrs: np.ndarray, first: np.ndarray, device: int) -> np.ndarray:
        start = (addrs[None, :] + first * size).reshape(-1)
        return np.stack([start, length, np.full_like(start, device)], axis=1).astype(np.uint64)

    return table(remote.addrs, r0, remote_device), table(local.addrs, l0, local_device)


class NixlEndpoint:
    """This instance's NIXL agent with its KV caches registered (once, here)."""

    def __init__(
        self,
        kv_caches: KVCaches,
        *,
        transfer_timeout: float = 60.0,
        agent_api: tuple[Any, Any] | None = None,
        backends: tuple[str, ...] = ("UCX",),
        num_threads: int = 0,
    ) -> None:
        agent_cls, config_cls = agent_api if agent_api is not None else load_nixl()
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.transfer_timeout = transfer_timeout
        self.name = f"pdserve-{uuid.uuid4().hex[:12]}"
        self.segments = Segments.of(kv_caches)
        tensors = [c for _, _, c in kv_caches.layers()]
        on_gpu = kv_caches.device.type == "cuda"
        self.mem_type = "VRAM" if on_gpu else "DRAM"
        self.device_id = tensors[0].get_device() if on_gpu and tensors else 0
        self._lock = threading.Lock()
        self._remotes: dict[bytes, tuple[str, int]] = {}  # metadata -> (agent name, users)
        if num_threads:
            # NIXL's thread-pool UCX backend: a UCX worker a thread, and a READ of at least
            # split_batch_size descriptors cut into one chunk a thread, each posted by its
            # thread on its worker. UCX's cuda_ipc keeps its CUDA streams per worker and
            # runs one worker's GETs from one GPU on one stream, one after another (RESULTS
            # run 110: 64 driver memcpys in a row for a 16K read); chunks on several
            # workers overlap both the posting and the copies. NIXL's own split threshold
            # (1,024 descriptors) is above any read here (one a segment and run of blocks).
            params = {"num_threads": str(num_threads), "split_batch_size": str(_SPLIT_DESCS)}
            self.agent = agent_cls(self.name, config_cls(backends=[]))
            for backend in backends:
                self.agent.create_backend(backend, params if backend == "UCX" else {})
        else:
            self.agent = agent_cls(self.name, config_cls(backends=list(backends)))
        self._registered = self.agent.register_memory(tensors) if tensors else None
        self.metadata = bytes(self.agent.get_agent_metadata())
        self.closed = False

    def info(self) -> dict[str, Any]:
        """The handshake payload: agent metadata, segments, memory kind and device."""
        return {
            "agent": self.metadata,
            "segments": self.segments.to_info(),
            "mem_type": self.mem_type,
            "device": self.device_id,
        }

    def attach(self, metadata: bytes) -> str:
        """Load a prefill agent's metadata (once per agent); its name."""
        with self._lock:
            name, users = self._remotes.get(metadata, ("", 0))
            if not users:
                got = self.agent.add_remote_agent(metadata)
                name = got.decode() if isinstance(got, bytes) else str(got)
            self._remotes[metadata] = (name, users + 1)
            return name

    def detach(self, metadata: bytes) -> None:
        with self._lock:
            name, users = self._remotes.get(metadata, ("", 0))
            if users > 1:
                self._remotes[metadata] = (name, users - 1)
                return
            self._remotes.pop(metadata, None)
            if users and not self.closed:
                self._quietly(self.agent.remove_remote_agent, name)

    def post_read(
        self, remote: str, remote_descs: np.ndarray, local_descs: np.ndarray, remote_mem: str
    ) -> tuple[Any, str]:
        """Post one READ of ``remote_descs`` into ``local_descs``: (handle, its state)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the NIXL agent is closed")
            local = self.agent.get_xfer_descs(local_descs, self.mem_type)
            far = self.agent.get_xfer_descs(remote_descs, remote_mem)
            handle = self.agent.initialize_xfer("READ", local, far, remote)
            return handle, self.agent.transfer(handle)

    def poll(self, handle: Any) -> str:
        with self._lock:
            return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        """Free a transfer request (NIXL cancels one still in progress)."""
        with self._lock:
            self._quietly(self.agent.release_xfer_handle, handle)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for name, _ in self._remotes.values():
                self._quietly(self.agent.remove_remote_agent, name)
            self._remotes.clear()
            if self._registered is not None:
                self._quietly(self.agent.deregister_memory, self._registered)

    @staticmethod
    def _quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # cleanup: log, never raise
            logger.warning("NIXL %s failed: %s", getattr(fn, "__name__", fn), e)


class NixlServer(ServerTransport):
    def __init__(self, kv_caches: KVCaches, endpoint: NixlEndpoint) -> None:
        super().__init__(kv_caches)
        self.endpoint = endpoint

    def transport_info(self) -> dict[str, Any]:
        return self.endpoint.info()

    def read(self, block_ids: list[int]) -> list[bytes | memoryview]:
        return []  # decode READs the blocks itself


class NixlClient(ClientTransport):
    reads_remote_memory = True

    def __init__(
        self, kv_caches: KVCaches, transport_info: dict[str, Any], endpoint: NixlEndpoint
    ) -> None:
        super().__init__(kv_caches, transport_info)
        self.endpoint = endpoint
        self.remote = Segments.from_info(transport_info["segments"])
        endpoint.segments.check_pairs_with(self.remote)
        self.remote_mem = str(transport_info["mem_type"])
        self.remote_device = int(transport_info["device"])
        self._metadata = bytes(transport_info["agent"])
        self.remote_name = endpoint.attach(self._metadata)
        self._closed = False
        # benchmarks set a list: each read appends its host times (perf_counter): begun,
        # posted (descriptors made, READ posted) and, once polled done, landed
        self.trace: list[dict[str, float]] | None = None

    def write(
        self, remote_block_ids: list[int], local_block_ids: list[int], frames: list[Any]
    ) -> int:
        return self.begin_write(
            remote_block_ids, local_block_ids, frames, self.endpoint.transfer_timeout
        ).wait()

    def begin_write(
        self,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        frames: list[Any],
        timeout: float = 60.0,
        *,
        after: Fence | None = None,
    ) -> PendingWrite:
        t0 = time.perf_counter()
        remote_ids = check_ids(remote_block_ids, self.remote.num_blocks, "prefill")
        local_ids = check_ids(local_block_ids, self.endpoint.segments.num_blocks, "decode")
        nbytes = self.kv_caches.bytes_per_block() * len(local_ids)
        if not len(local_ids):
            return PendingWrite(lambda: 0)
        remote, local = read_descriptors(
            self.remote,
            self.endpoint.segments,
            remote_ids,
            local_ids,
            self.remote_device,
            self.endpoint.device_id,
        )
        if after is not None:
            self.order_after(after)  # on the host: NIXL writes behind every stream's back
        handle, first = self.endpoint.post_read(self.remote_name, remote, local, self.remote_mem)
        state = [first]
        times = {"host_start": t0, "host_posted": time.perf_counter()}
        if self.trace is not None:
            self.trace.append(times)
        deadline = time.monotonic() + timeout
        what = f"the NIXL READ of {len(local_ids)} blocks ({len(local)} descriptors)"

        def landed() -> bool:
            if state[0] == "PROC":
                state[0] = self.endpoint.poll(handle)
            if state[0] == "PROC":
                return False
            times.setdefault("host_landed", time.perf_counter())
            return True

        def wait() -> int:
            try:
                polls = 0
                while not landed():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{what} did not complete in {timeout:g}s")
                    polls += 1
                    if polls > _SPIN_POLLS:
                        time.sleep(0.0002)
                if state[0] != "DONE":
                    raise RuntimeError(f"{what} from {self.remote_name} failed ({state[0]})")
                return nbytes
            finally:
                self.endpoint.release(handle)

        if state[0] == "ERR":
            self.endpoint.release(handle)
            raise RuntimeError(f"{what} from {self.remote_name} could not be posted")
        # ready: landed, failed, or out of time (wait then raises)
        return PendingWrite(wait, lambda: landed() or time.monotonic() > deadline)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.endpoint.detach(self._metadata)
