"""Mixture of experts as DeepSeek-V3 and GLM-5 use it: a sigmoid router with a correction
bias and grouped top-k (``noaux_tc``), routed experts, and shared experts.

Router (in float32 whatever the model dtype, as vLLM forces for these models):

    s = sigmoid(x W^T)                         scores, [T, E]
    c = s + e_score_correction_bias            used only to choose
    keep the topk_group groups whose two best c sum highest (n_group groups of E/n_group)
    experts = top-k of c within the kept groups
    weights = s[experts] / sum (if norm_topk_prob) * routed_scaling_factor

Experts are SwiGLU MLPs stored stacked: ``w13`` [E, 2I, H] (gate rows, then up rows, as
HF fuses them) and ``w2`` [E, H, I]; the checkpoint keeps them per expert and the model's
loader stacks them. The layer's output is the weighted sum of its token's experts plus
the shared experts' output.

Two reference paths compute the experts: eagerly, tokens are sorted by expert and each
expert runs one GEMM over its tokens (the expert counts are read on the host); while a
CUDA graph is being captured, every expert runs over every token and unchosen ones get
weight 0 (static shapes, no host sync; it reads each expert's weights once, as a decode
step of a large batch does anyway). Where the fused kernels are on (see
:mod:`pdserve.layers.fused`: CUDA, or ``PDSERVE_FUSED_KERNELS=1`` under the Triton
interpreter), :func:`pdserve.kernels.moe_router.router_select` does the router's
selection after its float32 GEMM, and :func:`pdserve.kernels.fused_moe.fused_experts`
replaces both expert paths: tokens aligned by expert on the device, a grouped gate/up
GEMM with SiLU-and-mul fused, a grouped down GEMM with the routing weights applied; no
host sync at any batch size. The shared experts stay a dense MLP (fused layers too); with
the fused kernels their output joins the routed rows' final sum (no add of its own).

Tensor parallelism (``groups.tp`` of size n): the router is replicated; every expert's
and the shared experts' intermediate dimension is split n ways (gate/up rows and down
columns, each HF tensor sliced on its own), each rank computes its partial output of
every token's experts, and the layer all-reduces the routed plus shared partials once.

FP8 checkpoints (and ``--quantization fp8``) keep the routed experts in block-scaled FP8
(:meth:`RoutedExperts.use_fp8`): the fused path runs
:func:`pdserve.kernels.fused_moe_fp8.fused_experts_fp8` (activations quantized per token
per 128 channels inside the kernel, or once by the post-attention norm, which then hands
the layer an :class:`~pdserve.kernels.reference.Fp8Activation` carrying its bf16 output
too: the router and expert-parallel dispatch read that, the FP8 experts the fp8 rows),
the torch path its graph-capturable reference (weights dequantized every call). Under TP each rank's share of the intermediate
dimension must be whole 128-blocks (refused otherwise, naming the layer): a rank then
holds its gate/up block rows and down block columns of every expert's scales, and its
activation groups are the full layer's.

Expert parallelism (``ep`` group of size > 1, :mod:`pdserve.layers.moe_dispatch`): each
rank holds the contiguous slice ``ep_rank*L .. (ep_rank+1)*L - 1`` of the experts
(``L = num_experts / ep_size``; ``w13``/``w2`` hold only those), routes its own tokens with
the replicated router and sends them to the owning ranks; shared experts stay local.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.groups import Group, ParallelGroups
from pdserve.kernels.reference import (
    FP8_DTYPE,
    FP8_GROUP,
    Fp8Activation,
    fused_experts_fp8_reference,
)
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.fp8_parallel import check_fp8_split
from pdserve.layers.fused import use_fused_kernels
from pdserve.layers.linear import Shard, empty_weight
from pdserve.layers.moe_dispatch import AllGatherDispatcher, AllToAllDispatcher
from pdserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    tp_divide,
)

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) for tokens ``x`` [T, H]."""
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias.float()
    num_experts = scores.shape[-1]
    if n_group > 1:
        per_group = num_experts // n_group
        group_scores = choice.view(-1, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class TopKRouter(nn.Module):
    """The gate: ``weight`` [E, H] and ``e_score_correction_bias`` [E], both float32."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False
        )
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.fused = use_fused_kernels()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:  # the float32 GEMM, then one kernel for the whole selection
            from pdserve.kernels.moe_router import (
                ROUTER_GEMM_MIN_TOKENS,
                router_logits,
                router_select,
            )

            if x.dtype == torch.bfloat16 and x.shape[0] >= ROUTER_GEMM_MIN_TOKENS:
                logits = router_logits(x.contiguous(), self.weight.float().contiguous())
            else:
                logits = F.linear(x.float(), self.weight.float())
            return router_select(
                logits,
                self.e_score_correction_bias,
                self.top_k,
                self.n_group,
                self.topk_group,
                self.norm_topk_prob,
                self.routed_scaling_factor,
            )
        return grouped_topk(
            x,
            self.weight,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


def experts_sorted(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Eager reference: sort (token, expert) pairs by expert, one GEMM pair per expert
    over its tokens, weighted, summed back per token (HF's arithmetic and order)."""
    t, k = ids.shape
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the host sync
    tokens = order // k
    slot = order % k
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start : start + n]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * weights[tok, slot[start : start + n], None]
        out.index_add_(0, tok, h.to(out.dtype))
        start += n
    return out


def experts_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Graph-capturable reference: every expert over every token, unchosen ones weighted 0."""
    dense = torch.zeros(ids.shape[0], w13.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids, weights)
    gate, up = torch.einsum("th,eih->eti", x, w13).chunk(2, dim=-1)
    h = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w2)  # [E, T, H]
    return (h.float() * dense.t().unsqueeze(-1)).sum(dim=0).to(x.dtype)


class RoutedExperts(nn.Module):
    """The stacked experts this rank holds: global experts ``expert_offset ..
    expert_offset + num_local_experts - 1`` of ``num_experts`` (all of them without
    expert parallelism); :meth:`forward` takes local expert ids. Under TP each holds its
    rank's slice of every expert's intermediate dimension (``intermediate_size`` is the
    local one).

    FP8 (:meth:`use_fp8`, called by the loader before any weight is loaded): ``w13`` and
    ``w2`` become float8_e4m3fn and ``w13_scale_inv`` / ``w2_scale_inv`` hold one float32
    scale per 128x128 block of every expert's gate, up and down projections (the layout
    of :mod:`pdserve.kernels.fused_moe_fp8`); the forward runs the FP8 fused kernel where
    fused kernels are on, else the dequantize-then-compute reference (every call)."""

    w13_scale_inv: torch.Tensor | None  # FP8 only (None otherwise)
    w2_scale_inv: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: Group | None = None,
        ep: Group | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or Group()
        self.ep = ep or Group()
        ep_size = self.ep.size
        if num_experts % ep_size:
            raise ValueError(
                f"n_routed_experts {num_experts} cannot be split evenly over {ep_size} "
                "expert-parallel ranks (--data-parallel-size must divide it)"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_offset = self.ep.rank * self.num_local_experts
        self.hidden_size = hidden_size
        intermediate_size = tp_divide(intermediate_size, self.tp, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        n = self.num_local_experts
        self.w13 = empty_weight(n, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.w2 = empty_weight(n, hidden_size, intermediate_size, dtype=dtype)
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)
        self.fused = use_fused_kernels()

    @property
    def fp8(self) -> bool:
        return self.w13.dtype == FP8_DTYPE

    def fp8_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``w13_scale_inv``, ``w2_scale_inv``) of an FP8 layer."""
        if self.w13_scale_inv is None or self.w2_scale_inv is None:
            raise RuntimeError("RoutedExperts holds no FP8 weights (use_fp8 was not called)")
        return self.w13_scale_inv, self.w2_scale_inv

    def use_fp8(self, device: torch.device | None = None, layer: str = "") -> None:
        """Swap the stacks for empty FP8 ones and their block scales, on ``device`` (default:
        the stacks' own; values are not kept: the loader fills them). Under TP a rank's
        share of the intermediate dimension must be whole 128-blocks: refused otherwise,
        naming ``layer`` (this module's path)."""
        full = self.intermediate_size * self.tp.size
        check_fp8_split(layer, "moe_intermediate_size", full, self.tp)
        e, two_i, h = self.w13.shape  # the experts this layer holds, whatever their count
        i, dev = two_i // 2, device if device is not None else self.w13.device
        nbh, nbi = -(-h // FP8_GROUP), -(-i // FP8_GROUP)
        for name, shape in (
            ("w13", (e, 2 * i, h)),
            ("w2", (e, h, i)),
            ("w13_scale_inv", (e, 2 * nbi, nbh)),  # gate's block rows, then up's
            ("w2_scale_inv", (e, nbh, nbi)),
        ):
            dtype = torch.float32 if name.endswith("_scale_inv") else FP8_DTYPE
            empty = torch.empty(shape, dtype=dtype, device=dev)
            setattr(self, name, nn.Parameter(empty, requires_grad=False))

    @property
    def local_expert_ids(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.expert_offset, self.expert_offset + self.num_local_experts)

    def forward(
        self,
        x: torch.Tensor | Fp8Activation,
        weights: torch.Tensor,
        ids: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The routed experts' output [T, H], plus ``add`` [T, H] where given (the shared
        experts' output: the fused kernels add it in their final sum, no launch of its own).
        An :class:`Fp8Activation` ``x`` (FP8 experts only) is read as quantized."""
        if self.fp8:
            s13, s2 = self.fp8_scales()
            if self.fused:
                from pdserve.kernels.fused_moe_fp8 import fused_experts_fp8

                return fused_experts_fp8(x, self.w13, s13, self.w2, s2, weights, ids, add=add)
            out = fused_experts_fp8_reference(x, self.w13, s13, self.w2, s2, weights, ids)
            return out if add is None else out + add
        xb = x.high_precision() if isinstance(x, Fp8Activation) else x
        if self.fused and self.w13.dtype in _FUSED_DTYPES:
            from pdserve.kernels.fused_moe import fused_experts

            return fused_experts(xb, self.w13, self.w2, weights, ids, add=add)
        capturing = xb.is_cuda and torch.cuda.is_current_stream_capturing()
        fn = experts_dense if capturing else experts_sorted
        out = fn(xb, self.w13, self.w2, weights, ids)
        return out if add is None else out + add

    def expert_views(self, e: int) -> dict[str, torch.Tensor]:
        """HF's per-expert names (relative to ``experts.{e}.``, ``e`` a global id this rank
        holds) -> views of the stacks (FP8: and of their ``weight_scale_inv`` blocks)."""
        if e not in self.local_expert_ids:
            raise IndexError(f"expert {e} is not held here ({self.local_expert_ids})")
        i, j = self.intermediate_size, e - self.expert_offset
        views = {
            "gate_proj.weight": self.w13.data[j, :i],
            "up_proj.weight": self.w13.data[j, i:],
            "down_proj.weight": self.w2.data[j],
        }
        if self.fp8:
            s13, s2 = self.fp8_scales()
            nbi = s13.shape[1] // 2
            views["gate_proj.weight_scale_inv"] = s13.data[j, :nbi]
            views["up_proj.weight_scale_inv"] = s13.data[j, nbi:]
            views["down_proj.weight_scale_inv"] = s2.data[j]
        return views

    def expert_shards(self) -> dict[str, Shard]:
        """The part of each full HF expert tensor this rank holds (none: whole)."""
        if self.tp.size == 1:
            return {}
        i, r, n = self.intermediate_size, self.tp.rank, self.tp.size
        rows = Shard(0, r * i, (r + 1) * i, n * i)
        out = {
            "gate_proj.weight": rows,
            "up_proj.weight": rows,
            "down_proj.weight": Shard(1, r * i, (r + 1) * i, n * i),
        }
        if self.fp8:  # whole 128-blocks per rank (use_fp8 checked)
            b = i // FP8_GROUP
            blocks = Shard(0, r * b, (r + 1) * b, n * b)
            out["gate_proj.weight_scale_inv"] = blocks
            out["up_proj.weight_scale_inv"] = blocks
            out["down_proj.weight_scale_inv"] = Shard(1, r * b, (r + 1) * b, n * b)
        return out


class DenseMLP(nn.Module):
    """SwiGLU MLP with HF names (``gate_proj``/``up_proj`` merged, ``down_proj``); under
    TP gate/up column-parallel and down row-parallel (``reduce_results=False``: the
    caller all-reduces the partial output)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: Group | None = None,
        reduce_results: bool = True,
        what: str = "intermediate_size",
    ) -> None:
        super().__init__()
        names = {"gate_proj": what, "up_proj": what}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            {"gate_proj": intermediate_size, "up_proj": intermediate_size},
            dtype=dtype,
            tp=tp,
            what=names,
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            dtype=dtype,
            tp=tp,
            what=what,
            reduce_results=reduce_results,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MoE(nn.Module):
    """Router (``gate``), routed ``experts`` and ``shared_experts``, named as HF names them.
    With ``groups.ep`` of size > 1 the routed experts are spread over its ranks and every
    forward is a collective over the group."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        n_shared_experts: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        dtype: torch.dtype,
        groups: ParallelGroups = ParallelGroups(),
    ) -> None:
        super().__init__()
        self.tp = groups.tp
        self.ep = groups.ep
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(
                f"n_group {n_group} must divide n_routed_experts {num_experts}, "
                f"and topk_group {topk_group} must be in 1..n_group"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
        self.gate = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        )
        self.experts = RoutedExperts(
            num_experts, hidden_size, moe_intermediate_size, dtype, self.tp, ep=self.ep
        )
        n_local = self.experts.num_local_experts
        self.all_to_all = AllToAllDispatcher(self.ep, n_local)
        self.all_gather = AllGatherDispatcher(self.ep, n_local)
        self.shared_experts = (
            DenseMLP(
                hidden_size,
                moe_intermediate_size * n_shared_experts,
                dtype,
                self.tp,
                reduce_results=False,
                what="moe_intermediate_size x n_shared_experts",
            )
            if n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """``x``: the post-attention norm's output, or its fp8 form carrying that output
        as ``hp`` (the router and expert-parallel dispatch read ``hp``; the FP8 shared and
        routed experts the fp8 values)."""
        hp = x.high_precision() if isinstance(x, Fp8Activation) else x
        weights, ids = self.gate(hp)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.ep.size == 1:  # the shared output joins the routed experts' final sum
            out = self.experts(x, weights, ids, add=shared)
        else:  # graph capture needs static shapes: the all-gather path (module docstring)
            capturing = hp.is_cuda and torch.cuda.is_current_stream_capturing()
            dispatch = self.all_gather if capturing else self.all_to_all
            out = dispatch(hp, weights, ids, self.experts)
            if shared is not None:
                out = out + shared
        return self.tp.all_reduce(out)  # the ranks' partial sums (identity without TP)
