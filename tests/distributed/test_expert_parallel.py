"""Expert parallelism with gloo: two ranks, each holding half the experts, against one
process holding all of them (the MoE layer's two dispatchers, and rank-aware loading)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _ranks import run_ranks
from pdserve.distributed import Group, ParallelGroups, RankInfo, init_parallel_groups
from pdserve.layers.moe import MoE
from pdserve.models import load_model

H, E, K, INTER = 32, 8, 3, 16


def _moe(groups: ParallelGroups | None = None) -> MoE:
    moe = MoE(H, E, K, INTER, 1, 2, 2, True, 2.5, torch.float32, groups or ParallelGroups())
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(p.shape if n.startswith(("gate", "shared")) else (E, *p.shape[1:]),
                           generator=g) * 0.1
            for n, p in moe.named_parameters()}  # fmt: skip
    off = moe.experts.expert_offset
    n_local = moe.experts.num_local_experts
    with torch.no_grad():
        for n, p in moe.named_parameters():
            src = full[n]
            p.copy_(src[off : off + n_local] if n.startswith("experts.") else src)
    return moe


def _tokens(rank: int) -> torch.Tensor:
    n = (5, 9)[rank]  # uneven batches
    return torch.randn(n, H, generator=torch.Generator().manual_seed(10 + rank))


def _worker(rank: int, init_file: str, out_dir: str, ckpt: str) -> None:
    torch.set_num_threads(1)  # two ranks share the host's cores (as engine-core ranks do)
    info = RankInfo(dp_size=2, dp_rank=rank)
    groups = init_parallel_groups(info, init_file, torch.device("cpu"), expert_parallel=True)
    moe = _moe(groups)
    x = _tokens(rank)
    res: dict[str, object] = {"a2a": moe(x)}
    # an empty batch on one rank (the other still gets its tokens computed)
    res["a2a_empty"] = moe(x[:0] if rank == 0 else x)
    # the all-gather path (used under graph capture) needs equal T on every rank
    w, ids = moe.gate(x[:5])
    res["gather"] = moe.all_gather(x[:5], w, ids, moe.experts)
    model, _ = load_model(ckpt, "float32", load_format="auto", groups=groups)
    dummy, _ = load_model(ckpt, "float32", load_format="dummy", seed=2, groups=groups)
    experts = model.model.layers[1].mlp.experts  # type: ignore[union-attr,index]
    res["loaded_w13"] = experts.w13.clone()
    res["dummy_w13"] = dummy.model.layers[1].mlp.experts.w13.clone()  # type: ignore[union-attr,index]
    res["offset"] = experts.expert_offset
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    groups.destroy()


def test_two_ep_ranks_match_one_process(tiny_glm5: Path, tmp_path: Path) -> None:
    results = run_ranks(_worker, 2, tmp_path, str(tiny_glm5))
    ref = _moe()
    full, _ = load_model(tiny_glm5, "float32")
    full_dummy, _ = load_model(tiny_glm5, "float32", load_format="dummy", seed=2)
    w13 = full.model.layers[1].mlp.experts.w13  # type: ignore[union-attr,index]
    w13_dummy = full_dummy.model.layers[1].mlp.experts.w13  # type: ignore[union-attr,index]
    for rank, res in enumerate(results):
        x = _tokens(rank)
        with torch.no_grad():
            want = ref(x)
            torch.testing.assert_close(res["a2a"], want, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(res["a2a_empty"], want[:0] if rank == 0 else want)
            routed = ref.experts(x[:5], *ref.gate(x[:5]))  # the dispatcher's part: no shared
            torch.testing.assert_close(res["gather"], routed, rtol=1e-5, atol=1e-6)
        off = res["offset"]
        assert off == rank * 4 and res["loaded_w13"].shape[0] == 4
        assert torch.equal(res["loaded_w13"], w13[off : off + 4])
        assert torch.equal(res["dummy_w13"], w13_dummy[off : off + 4])


def test_experts_must_split_evenly() -> None:
    with pytest.raises(ValueError, match="cannot be split evenly over 3"):
        three = Group(size=3, rank=0, ranks=(0, 1, 2))
        MoE(H, E, K, INTER, 1, 1, 1, True, 1.0, torch.float32, ParallelGroups(ep=three))
