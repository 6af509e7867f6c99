"""The address math of the one-launch block copy (cuda_ipc's kernel, nixl's descriptors):
its torch reference moves exactly what a per-layer index_copy along each layer's own
block axis moves, for every group (own layout and dtype), with different pool sizes on
the two ends; ids out of range and caches that do not pair are refused. On a GPU the
Triton kernel is checked against the reference."""

from __future__ import annotations

import pytest
import torch

from _ipc_peer import filled_caches
from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig
from pdserve.forward_context import KVCaches
from pdserve.kv_transfer.transports.block_copy import (
    CopyPlan,
    Segments,
    copy_blocks,
    reference_copy,
)


def _config(dtype: str = "bfloat16", codes: bool = True) -> KVCacheConfig:
    gqa = CacheLayout("gqa", dtype, (2, 1, 4, 2, 8), block_axis=1)
    layers = [("l0.attn", "attn", gqa), ("l1.attn", "attn", gqa)]
    if codes:
        layers.append(("l0.codes", "codes", CacheLayout("codes", "uint8", (1, 4, 3), 0)))
    return KVCacheConfig.from_layers(4, layers)


def _tensors(c: KVCaches) -> list[torch.Tensor]:
    return [t for _, _, t in c.layers()]


def _expected(src: KVCaches, dst: KVCaches, remote: list[int], local: list[int]) -> None:
    for (_, lay, s), (_, _, d) in zip(src.layers(), dst.layers(), strict=True):
        ax = lay.block_axis
        r, l_ = torch.tensor(remote, dtype=torch.int64), torch.tensor(local, dtype=torch.int64)
        d.index_copy_(ax, l_, s.index_select(ax, r))


@pytest.mark.parametrize(
    ("remote", "local"),
    [([7, 2, 3], [1, 5, 13]), ([2, 3, 4, 5], [6, 7, 8, 9]), ([9, 0], [0, 9]), ([], [])],
)
@pytest.mark.parametrize(("dtype", "codes", "unit"), [("bfloat16", True, 4), ("float32", False, 8)])
def test_reference_copy_matches_a_per_layer_index_copy(
    remote: list[int], local: list[int], dtype: str, codes: bool, unit: int
) -> None:
    cfg = _config(dtype, codes)
    src = filled_caches(cfg, 10, "cpu", 0)  # prefill: 10 blocks
    got = KVCaches.allocate(cfg, 14, torch.device("cpu"))  # decode: 14
    want = KVCaches.allocate(cfg, 14, torch.device("cpu"))
    plan = CopyPlan.make(Segments.of(src), Segments.of(got), torch.device("cpu"))
    assert plan.unit == unit  # 12-byte code blocks: 4-byte units
    assert plan.aligned16 == (not codes)  # without them: 16-byte accesses
    assert len(plan.src.addrs) == 4 + codes  # two K/V halves per attention layer
    reference_copy(plan, _tensors(src), _tensors(got), remote, local)
    _expected(src, want, remote, local)
    for (name, _, g), (_, _, w) in zip(got.layers(), want.layers(), strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name


def test_ids_out_of_range_and_unpaired_caches_are_refused() -> None:
    src = filled_caches(_config(), 10, "cpu", 0)
    dst = KVCaches.allocate(_config(), 6, torch.device("cpu"))
    plan = CopyPlan.make(Segments.of(src), Segments.of(dst), torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"source block id out of range \[0, 10\)"):
        plan.block_pairs([10], [0])
    with pytest.raises(RuntimeError, match=r"destination block id out of range \[0, 6\)"):
        plan.block_pairs([1, 2], [5, 6])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        plan.block_pairs([1, 2], [5])
    other = KVCaches.allocate(_config(codes=False), 6, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="caches differ"):
        CopyPlan.make(Segments.of(src), Segments.of(other), torch.device("cpu"))


def test_launch_shapes_are_checked() -> None:
    from pdserve.kernels.kv_block_copy import launch_shape

    assert launch_shape(None, None) == (8192, 4)
    assert launch_shape(32768, 8) == (32768, 8)
    for step, warps, why in [(1000, 4, "power of two"), (256, 4, "512, 65536"), (8192, 3, "warps")]:
        with pytest.raises(ValueError, match=why):
            launch_shape(step, warps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("codes", [True, False])  # False: 16-byte aligned, paired accesses
@pytest.mark.parametrize("shape", [(None, None), (512, 1), (32768, 8)])  # steps < and > a block
def test_triton_block_copy_matches_the_reference(
    dtype: str, codes: bool, shape: tuple[int | None, int | None]
) -> None:
    cfg = _config(dtype, codes)
    src = filled_caches(cfg, 40, "cuda", 1)
    got = KVCaches.allocate(cfg, 50, torch.device("cuda"))
    want = KVCaches.allocate(cfg, 50, torch.device("cuda"))
    remote, local = [3, 4, 5, 39, 0, 17], [10, 11, 12, 49, 2, 30]
    plan = CopyPlan.make(Segments.of(src), Segments.of(got), torch.device("cuda"))
    stream = torch.cuda.Stream()
    copy_blocks(plan, plan.block_pairs(remote, local), stream, *shape)
    stream.synchronize()
    # the reference resolves the plan's destination addresses in the tensors it is given:
    # it needs a plan of its own, made against ``want``
    ref_plan = CopyPlan.make(Segments.of(src), Segments.of(want), torch.device("cuda"))
    reference_copy(ref_plan, _tensors(src), _tensors(want), remote, local)
    for (name, _, g), (_, _, w) in zip(got.layers(), want.layers(), strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), name
