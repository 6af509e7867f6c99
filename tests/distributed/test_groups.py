"""Process groups and collectives with gloo, several processes on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _ranks import run_ranks
from pdserve.distributed import Group, RankInfo, init_parallel_groups


def _worker(rank: int, init_file: str, out_dir: str, tp: int, dp: int) -> None:
    info = RankInfo(tp_size=tp, tp_rank=rank % tp, dp_size=dp, dp_rank=rank // tp)
    g = init_parallel_groups(info, init_file, torch.device("cpu"), expert_parallel=True)
    res: dict[str, object] = {"tp_ranks": g.tp.ranks, "dp_ranks": g.dp.ranks}
    x = torch.full((2,), float(rank + 1))
    res["tp_sum"] = g.tp.all_reduce(x.clone()).tolist()
    res["dp_gather"] = g.dp.all_gather(torch.tensor([rank]), dim=0).tolist()
    # rank r sends r+1 rows to each peer (value 10*r + peer); receives peer+1 rows from each
    n_peers = g.ep.size
    send = torch.cat([torch.full((rank + 1,), 10 * rank + p) for p in range(n_peers)])
    recv_sizes = [r_peer + 1 for r_peer in g.ep.ranks]
    got = g.ep.all_to_all(send, recv_sizes, [rank + 1] * n_peers)
    res["a2a"] = got.tolist()
    res["max"] = g.dp.max_cpu([rank, -rank])
    res["bcast"] = g.tp.broadcast_bytes(b"hello" * (rank + 1) if g.tp.rank == 0 else None)
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    g.destroy()


def test_single_process_groups_are_identities() -> None:
    g = Group()
    x = torch.arange(3.0)
    assert g.all_reduce(x) is x and g.all_gather(x) is x and g.all_to_all(x) is x
    assert g.max_cpu([1, 2]) == [1, 2] and g.broadcast_bytes(b"x") == b"x"
    groups = init_parallel_groups(RankInfo(), "/nonexistent", torch.device("cpu"))
    assert groups.tp.size == 1 and groups.dp.size == 1 and not groups.initialized


def test_rank_info_is_checked() -> None:
    assert RankInfo(tp_size=2, tp_rank=1, dp_size=3, dp_rank=2).rank == 5
    with pytest.raises(ValueError, match="rank out of range"):
        RankInfo(tp_size=2, tp_rank=2)


def test_tp2_dp2_groups_and_collectives(tmp_path: Path) -> None:
    tp, dp = 2, 2
    res = run_ranks(_worker, tp * dp, tmp_path, tp, dp)
    for r in range(4):
        d_rank, t_rank = divmod(r, tp)
        assert res[r]["tp_ranks"] == (2 * d_rank, 2 * d_rank + 1)
        assert res[r]["dp_ranks"] == (t_rank, t_rank + 2)
        assert res[r]["tp_sum"] == [float(2 * (2 * d_rank) + 3)] * 2
        assert res[r]["dp_gather"] == [t_rank, t_rank + 2]
        peers = res[r]["dp_ranks"]
        me = peers.index(r)
        assert res[r]["a2a"] == [v for p in peers for v in [10 * p + me] * (p + 1)]
        assert res[r]["max"] == [t_rank + 2, -t_rank]
        assert res[r]["bcast"] == b"hello" * (2 * d_rank + 1)
