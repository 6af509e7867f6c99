"""Expert parallelism: tokens sent to the ranks that own their experts, and back.

Experts are partitioned contiguously over the ``ep`` group: rank ``r`` owns global
experts ``r*L .. (r+1)*L - 1`` (``L = num_experts / ep_size``). The router is replicated,
so every rank routes its own tokens exactly as a single process would; only the expert
computation moves. A dispatcher takes a rank's tokens ``x`` [T, H] with their routing
(``weights`` and global expert ``ids``, [T, k]) and a ``local_experts(x, weights,
local_ids)`` callable (the rank's own experts: the fused Triton kernel on GPU, the torch
reference on CPU) and returns the routed experts' output [T, H] for its tokens. It is a
collective: every rank of the group calls it for every MoE layer of every forward.

Two implementations behind :class:`ExpertDispatcher`:

- :class:`AllToAllDispatcher` (eager steps): the (token, expert) pairs are sorted by
  expert (hence by owning rank), the per-rank counts are exchanged and read on the host
  (the one sync), and ``all_to_all_single`` with those split sizes moves the token rows
  and, packed in one float64 tensor, their local expert id and routing weight. Each rank
  runs its experts over what it received (one row per pair, the weight applied), sends
  the rows back the same way, and the owner adds them into its tokens in expert order,
  the order the single-process reference adds them. Moves only what is needed, but the
  split sizes depend on the data: it cannot be captured in a CUDA graph.
- :class:`AllGatherDispatcher` (CUDA-graph capture and replay): static shapes, no host
  sync. Every rank gathers every rank's tokens and routing (all ranks must pass the same
  ``T``: the DP step agreement pads every rank to the same captured batch), computes its
  experts' weighted contribution to all of them (pairs of other ranks' experts weighted
  0), and an equal-split all-to-all returns each rank its tokens' partial sums, which it
  adds up. It moves ``ep_size * T`` rows each way, about what an all-to-all moves when
  top-k is comparable to ``ep_size`` (GLM-5: k=8), and is what decode batches replay.

So under expert parallelism every eager step (prompts, chunks, mixed batches, and any
decode batch without a graph) exchanges split sizes with one host sync per MoE layer;
uniform decode batches that replay a graph run the all-gather path. A faster backend
(DeepEP-style kernels, fixed-capacity splits) plugs in behind the same interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from pdserve.distributed.groups import Group

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertDispatcher(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local_experts: LocalExperts,
    ) -> torch.Tensor: ...


class _EPDispatcher:
    """What both dispatchers know: the expert-parallel group and how many experts each
    rank owns (expert ``e`` lives on rank ``e // num_local``)."""

    def __init__(self, ep: Group, num_local_experts: int) -> None:
        self.ep = ep
        self.num_local = num_local_experts


class AllToAllDispatcher(_EPDispatcher):
    """Variable-split all-to-all (eager only; see the module docstring)."""

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local_experts: LocalExperts,
    ) -> torch.Tensor:
        ep, n_local = self.ep, self.num_local
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # by expert, hence by owning rank
        sorted_ids = flat[order]
        tokens = order // k
        dest = sorted_ids // n_local
        send_counts = torch.bincount(dest, minlength=ep.size)
        recv_counts = ep.all_to_all(send_counts)  # one count per peer, equal splits
        counts = torch.cat([send_counts, recv_counts]).tolist()  # the host sync
        send_splits, recv_splits = counts[: ep.size], counts[ep.size :]
        meta = torch.stack(
            [(sorted_ids % n_local).double(), weights.flatten()[order].double()], dim=1
        )
        recv_x = ep.all_to_all(x[tokens], recv_splits, send_splits)
        recv_meta = ep.all_to_all(meta, recv_splits, send_splits)
        local_ids = recv_meta[:, :1].long()
        local_w = recv_meta[:, 1:].to(weights.dtype)
        y = local_experts(recv_x, local_w, local_ids)  # one weighted row per pair
        back = ep.all_to_all(y, send_splits, recv_splits)
        out = torch.zeros_like(x)
        out.index_add_(0, tokens, back.to(out.dtype))
        return out


class AllGatherDispatcher(_EPDispatcher):
    """Equal-shape all-gather / all-to-all (graph-capturable; see the module docstring)."""

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        local_experts: LocalExperts,
    ) -> torch.Tensor:
        ep, n_local = self.ep, self.num_local
        t = x.shape[0]
        all_x = ep.all_gather(x, dim=0)
        all_ids = ep.all_gather(ids, dim=0)
        all_w = ep.all_gather(weights, dim=0)
        mine = all_ids // n_local == ep.rank
        local_ids = torch.where(mine, all_ids - ep.rank * n_local, 0)
        local_w = torch.where(mine, all_w, 0.0)
        partial = local_experts(all_x, local_w, local_ids)  # [ep_size * T, H]
        back = ep.all_to_all(partial)  # chunk p: rank p's partial sums for my tokens
        return back.view(ep.size, t, -1).float().sum(dim=0).to(x.dtype)
