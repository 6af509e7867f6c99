"""Tensor-parallel layers against their single-process counterparts (two gloo ranks), and
rank-aware loading: each rank holds exactly its slice of the weights one process loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _ranks import run_ranks
from pdserve.distributed import Group, ParallelGroups, RankInfo, init_parallel_groups
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.layers.linear import Linear, MergedLinear, checkpoint_entries, checkpoint_targets
from pdserve.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pdserve.models import load_model

VOCAB = 11  # odd: rank 1's block of 6 rows holds 5 ids and one padding row
HIDDEN, INTER = 8, 12


def _load_from(layer: torch.nn.Module, full: torch.nn.Module) -> None:
    """Copy ``full``'s checkpoint tensors into ``layer`` through its shards."""
    want = checkpoint_targets(full)
    for name, (target, shard) in checkpoint_entries(layer).items():
        target.copy_(shard.of(want[name]) if shard is not None else want[name])


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    groups = init_parallel_groups(RankInfo(tp_size=2, tp_rank=rank), init_file, torch.device("cpu"))
    tp = groups.tp
    gen = torch.Generator().manual_seed(0)

    def fill(m: torch.nn.Module) -> torch.nn.Module:
        for p in m.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen))
        return m

    x = torch.randn(5, HIDDEN, generator=gen)
    ids = torch.tensor([0, 5, 6, 10, 3, 7])  # ids on both ranks' blocks
    parts = {"a": 8, "b": 4}
    col, row = fill(Linear(HIDDEN, INTER, bias=True)), fill(Linear(INTER, HIDDEN, bias=True))
    merged = fill(MergedLinear(HIDDEN, parts, bias=True))
    emb, head = fill(VocabEmbedding(VOCAB, HIDDEN)), fill(LMHead(VOCAB, HIDDEN))

    pcol = ColumnParallelLinear(HIDDEN, INTER, bias=True, tp=tp)
    prow = RowParallelLinear(INTER, HIDDEN, bias=True, tp=tp)
    prow_partial = RowParallelLinear(INTER, HIDDEN, bias=True, tp=tp, reduce_results=False)
    pmerged = MergedColumnParallelLinear(HIDDEN, parts, bias=True, tp=tp)
    pemb = VocabEmbedding(VOCAB, HIDDEN, tp=tp)
    phead, ptied = LMHead(VOCAB, HIDDEN, tp=tp), LMHead(VOCAB, HIDDEN, tied=pemb, tp=tp)
    for layer, full in (
        (pcol, col),
        (prow, row),
        (prow_partial, row),
        (pmerged, merged),
        (pemb, emb),
        (phead, head),
    ):
        _load_from(layer, full)

    h = torch.relu(col(x))
    diffs = {
        # column then row: one all-reduce gives the whole two-layer output
        "col_row": (prow(pcol(x).relu()), row(h)),
        "row_partial": (tp.all_reduce(prow_partial(h.chunk(2, dim=-1)[rank])), row(h)),
        # rank r holds [a_r | b_r]
        "merged": (
            pmerged(x),
            torch.cat(
                [merged(x)[:, :8].chunk(2, -1)[rank], merged(x)[:, 8:].chunk(2, -1)[rank]], -1
            ),
        ),
        "embedding": (pemb(ids), emb(ids)),
        "lm_head": (phead(x), head(x)),
        "tied_head": (ptied(x), torch.nn.functional.linear(x, emb.weight)),
    }
    res = {
        k: (tuple(a.shape) == tuple(b.shape), float((a - b).abs().max()))
        for k, (a, b) in diffs.items()
    }
    res["pad_rows_zero"] = (True, float(pemb.weight[5:].abs().max()) if rank == 1 else 0.0)
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    groups.destroy()


def test_parallel_layers_match_single_process(tmp_path: Path) -> None:
    for rank, res in enumerate(run_ranks(_worker, 2, tmp_path)):
        assert set(res) >= {"col_row", "row_partial", "merged", "embedding", "lm_head"}
        for name, (same_shape, err) in res.items():
            assert same_shape and err < 1e-5, (rank, name, err)


def _rank_groups(rank: int, size: int = 2) -> ParallelGroups:
    """A rank's groups for building and loading only (no process group: never run)."""
    info = RankInfo(tp_size=size, tp_rank=rank)
    return ParallelGroups(info=info, tp=Group(size=size, rank=rank, ranks=tuple(range(size))))


def _entries(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, object]]:
    own = getattr(model, "_entries", None)
    return own() if own is not None else checkpoint_entries(model)


@pytest.mark.parametrize("fmt", ["auto", "dummy"])
@pytest.mark.parametrize("arch", ["llama", "glm5"])
def test_each_rank_loads_its_slice(arch: str, fmt: str, tiny_llama: Path, tiny_glm5: Path) -> None:
    path = tiny_llama if arch == "llama" else tiny_glm5
    full, _ = load_model(path, "float32", load_format=fmt, seed=3)
    whole = {n: t for n, (t, _) in _entries(full).items()}
    rank1, _ = load_model(path, "float32", load_format=fmt, seed=3, groups=_rank_groups(1))
    entries = _entries(rank1)
    assert set(entries) == set(whole)
    sharded = 0
    for name, (t, shard) in entries.items():
        want = shard.of(whole[name]) if shard is not None else whole[name]  # type: ignore[attr-defined]
        assert torch.equal(t, want), name
        sharded += shard is not None
    assert sharded > len(entries) // 3  # heads, MLP / experts and vocabulary are split
