"""Process groups for tensor (TP) and data/expert (DP, EP) parallelism.

Lifecycle: every rank process calls :func:`init_parallel_groups` once, before it builds
the model, with the same ``init_file`` (a file path in a directory private to the
instance; torch's ``FileStore`` rendezvous, so no port is picked and none can collide)
and its own :class:`RankInfo`. The call returns when all ``world_size`` ranks have
joined. :meth:`ParallelGroups.destroy` ends it at shutdown.

Each :class:`Group` has two torch process groups over the same ranks: ``device`` for
tensors on the model's device (NCCL on CUDA, gloo on CPU) and ``cpu`` (always gloo) for
control traffic: step inputs broadcast from a leader, the DP step agreement. Collectives
on a group of size 1 are the identity and never touch ``torch.distributed``.

A peer that dies makes the survivors' next collective raise (gloo notices the closed
connection) or time out after ``timeout_s``; callers turn that into an engine error.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankInfo:
    """Where one process sits in its instance: ``rank = dp_rank * tp_size + tp_rank``."""

    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1 (tp={self.tp_size}, dp={self.dp_size})")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.dp_rank < self.dp_size):
            raise ValueError(
                f"rank out of range: tp_rank={self.tp_rank}/{self.tp_size}, "
                f"dp_rank={self.dp_rank}/{self.dp_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def is_tp_leader(self) -> bool:
        return self.tp_rank == 0


@dataclass
class Group:
    """A set of ranks with its collectives. ``size == 1`` (the default): identities."""

    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = (0,)  # global ranks, in group-rank order
    device: dist.ProcessGroup | None = field(default=None, repr=False)
    cpu: dist.ProcessGroup | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in group-rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device)
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self,
        x: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """``torch.distributed.all_to_all_single`` along dim 0 (equal splits when None)."""
        if self.size == 1:
            return x
        rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes, input_split_sizes, group=self.device
        )
        return out

    def max_cpu(self, values: list[int]) -> list[int]:
        """Element-wise maximum of small integer vectors over the group (on the CPU group)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu)
        return [int(v) for v in t.tolist()]

    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes:
        """``payload`` of group rank ``src`` delivered to every rank (others pass None)."""
        if self.size == 1:
            assert payload is not None
            return payload
        src_global = self.ranks[src]
        n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(n, src=src_global, group=self.cpu)
        if self.rank == src:
            assert payload is not None
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, src=src_global, group=self.cpu)
        return payload if self.rank == src and payload is not None else buf.numpy().tobytes()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu)


@dataclass
class ParallelGroups:
    """The groups a rank takes part in. ``ep`` is the DP group when expert parallelism
    is on (experts spread over the DP ranks), else a size-1 group."""

    info: RankInfo = field(default_factory=RankInfo)
    tp: Group = field(default_factory=Group)
    dp: Group = field(default_factory=Group)
    ep: Group = field(default_factory=Group)
    initialized: bool = False

    def destroy(self) -> None:
        if self.initialized and dist.is_initialized():
            dist.destroy_process_group()
        self.initialized = False


def device_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel_groups(
    info: RankInfo,
    init_file: str,
    device: torch.device,
    *,
    expert_parallel: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelGroups:
    """Join the instance's ranks (blocks until all have joined) and build the groups.

    A world of one process returns size-1 groups without initialising
    ``torch.distributed``. Every rank creates every group, in the same order, as
    ``torch.distributed.new_group`` requires.
    """
    if info.world_size == 1:
        return ParallelGroups(info=info)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        device_backend(device),
        init_method=f"file://{init_file}",
        world_size=info.world_size,
        rank=info.rank,
        timeout=timeout,
        # NCCL binds its communicator to this device
        device_id=device if device.type == "cuda" else None,
    )
    tp_size, dp_size = info.tp_size, info.dp_size
    tp_sets = [tuple(d * tp_size + t for t in range(tp_size)) for d in range(dp_size)]
    dp_sets = [tuple(d * tp_size + t for d in range(dp_size)) for t in range(tp_size)]
    mine_tp = tp_sets[info.dp_rank]
    mine_dp = dp_sets[info.tp_rank]
    tp = dp = None
    for ranks in tp_sets:
        g = _make_group(ranks, info.rank, timeout)
        if ranks == mine_tp:
            tp = g
    for ranks in dp_sets:
        g = _make_group(ranks, info.rank, timeout)
        if ranks == mine_dp:
            dp = g
    assert tp is not None and dp is not None
    ep = dp if expert_parallel else Group()
    return ParallelGroups(info=info, tp=tp, dp=dp, ep=ep, initialized=True)


def _make_group(ranks: tuple[int, ...], me: int, timeout: datetime.timedelta) -> Group:
    if len(ranks) == 1:  # new_group is collective even for one rank: create, use trivially
        dist.new_group(list(ranks), timeout=timeout)
        dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        return Group()
    device = dist.new_group(list(ranks), timeout=timeout)
    cpu = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
    rank = ranks.index(me) if me in ranks else -1
    return Group(size=len(ranks), rank=rank, ranks=ranks, device=device, cpu=cpu)
