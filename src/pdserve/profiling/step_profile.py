"""Where one engine step's time goes: a ``torch.profiler`` capture of the step, its device
time by kernel category, and the idle gaps between kernels (``benchmarks/glm5_bench.py
--profile``).

Categories (:data:`CATEGORIES`): routed MoE experts (the fused expert kernels and their
token alignment), the MoE router, MLA attention (the latent-cache write, the attention
kernel and its split combine, the absorbed ``W_UK`` / ``W_UV`` products), the DSA
indexer's scoring (its scores and everything around them but the select), the indexer's
top-k select, dense GEMMs (every linear layer: attention projections, indexer
projections, dense MLPs and shared experts, LM head), norms and RoPE (with the fused
kernels that also write this step's cache rows), and the rest.

How a kernel gets its category:

- **eager steps**: while profiling, forward hooks put a ``record_function`` range named
  ``pdserve:<category>`` around every module of a known kind (:func:`module_category`).
  A kernel inherits the innermost range around the operator that launched it, except
  that a select / sort kernel inside the indexer is ``topk_select`` and a norm or RoPE
  kernel inside attention or the indexer is ``norm_rope`` (by name, :data:`NAME_RULES`).
  The router and the routed experts keep everything they launch (the experts' token
  alignment sorts too). A kernel outside every range goes by its name alone.
- **CUDA-graph replays** launch all their kernels from one ``cudaGraphLaunch``, so no
  module range reaches them. Their kernel names are matched in order against an eager
  run of the same captured forward (:func:`align_categories`: the graph's batch shape
  and metadata, run eagerly); a kernel the alignment misses takes the category its name
  had most often in that eager run, else the name rules.
- **on a CPU** there are no kernels: each operator's self time counts, categorised the
  same way.

A kernel launched early by programmatic dependent launch waits for its predecessor inside
its own span; it counts from the end of the kernel before it on its stream
(:func:`clip_waits`), so the wait stays with the kernel that caused it.

The idle gap is the step's device span (first kernel start to last kernel end; on a CPU
the profiled span) less the time some kernel (operator) ran: launch latency, host work
the device waited for, synchronisations. Shares are of that span.
"""

from __future__ import annotations

import difflib
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = (
    "moe_experts",
    "router",
    "mla_attention",
    "indexer_score",
    "topk_select",
    "dense_gemm",
    "norm_rope",
    "other",
)
GAP = "idle_gap"
SCOPE_PREFIX = "pdserve:"

# (category, pattern over the lower-cased kernel or operator name); the first match wins
NAME_RULES: tuple[tuple[str, str], ...] = (
    ("router", r"_router_kernel|_router_logits_kernel"),  # before the indexer's _logits_kernel
    ("topk_select", r"topk|_select_kernel|radix|sort|kthvalue|bitonic"),
    ("indexer_score", r"_logits_kernel"),
    # (the sparse MLA kernels: decode/verify, the prefill kernels and their candidate rows)
    ("mla_attention", r"_mla_kernel|_prefill_kernel|_gluon_ws_kernel|_rows_kernel|decode_attention|flash"),
    ("moe_experts",
     r"_gate_up(_fp8)?_kernel|_down(_fp8)?_kernel|fused_moe|_align_kernel|_combine_kernel"),
    # the fused preparation kernels (norm + RoPE + cache write) count as norms and RoPE
    ("norm_rope", r"rms_?norm|layer_?norm|_rope_kernel|rotary|_prep_kernel|_rope_kv_write"),
    (
        "dense_gemm",
        r"gemm|gemv|nvjet|cutlass|xmma|cublas|s16816|s1688|splitk"
        r"|aten::(mm|addmm|bmm|linear|matmul)$",
    ),
)
_RULES = tuple((cat, re.compile(pat)) for cat, pat in NAME_RULES)
_KEEP_SCOPE = ("moe_experts", "router")  # everything these launch is theirs
_KIND_OVER = ("indexer_score", "mla_attention", "other")  # scopes a kind rule overrides
_OWN_KERNELS = ("indexer_score", "mla_attention", "moe_experts", "router")  # name decides
# pdserve's own select and norm / RoPE kernels: no range but their own launches them
_OWN_NAMES = re.compile(r"_select_kernel|rmsnorm|_prep_kernel|_rope_kernel|_rope_kv_write")


def name_category(name: str) -> str | None:
    """The category :data:`NAME_RULES` give a kernel or operator name (None: no rule)."""
    low = name.lower()
    for cat, pat in _RULES:
        if pat.search(low):
            return cat
    return None


def categorize(name: str, scope: str | None) -> str:
    """The category of a kernel named ``name`` launched inside the module range ``scope``
    (None: outside every range). A kernel that only one category launches (sparse MLA,
    indexer scores, the fused MoE, the router) is that category's in any range: a range
    left open (a profiler cycle that dropped its end) then cannot swallow them, as it
    swallowed a 64K prefill's attention and experts into indexer_score (run 43); nor
    pdserve's own select, norm and RoPE kernels (an 8K-chunk prefill's MoE range took
    them, run 60), nor a library GEMM kernel the indexer's range (run 140: the GPU
    indexer launches none of its own). A GEMM launched in the attention range is the
    absorbed ``kv_b_proj`` (batched GEMMs, a dense GEMM's work; on a CPU the torch
    reference's own score and value products are ``bmm`` too and land there as well)."""
    rule = name_category(name)
    if rule in _OWN_KERNELS or (rule is not None and _OWN_NAMES.search(name.lower())):
        return rule
    if scope in _KEEP_SCOPE:
        return scope
    if rule == "dense_gemm" and scope == "mla_attention":
        return rule  # the absorbed W_UK / W_UV products (prefill_flops counts them as dense)
    if rule == "dense_gemm" and scope == "indexer_score" and not name.startswith("aten::"):
        # a library GEMM kernel: the GPU indexer scores with its own kernels, so this is a
        # projection whose range was lost (a 64K prefill's dense GEMMs, run 140); on a
        # CPU the torch reference's score products are aten operators and stay there
        return rule
    if rule in ("topk_select", "norm_rope") and (scope is None or scope in _KIND_OVER):
        return rule
    if scope is not None:
        return scope
    return rule or "other"


def module_category(mod: Any) -> str | None:
    """The range a module of a known kind runs in (None: it gets none of its own)."""
    from pdserve.layers.attention.dsa import Indexer
    from pdserve.layers.attention.mla import MLAAttention
    from pdserve.layers.embedding import LMHead
    from pdserve.layers.linear import Linear
    from pdserve.layers.moe import MoE, RoutedExperts, TopKRouter
    from pdserve.layers.norm import LayerNorm, RMSNorm

    kinds: tuple[tuple[type | tuple[type, ...], str], ...] = (
        (TopKRouter, "router"),
        (RoutedExperts, "moe_experts"),
        (MoE, "moe_experts"),  # its own leftovers (routed + shared sum); children override
        (MLAAttention, "mla_attention"),
        (Indexer, "indexer_score"),
        ((RMSNorm, LayerNorm), "norm_rope"),
        ((Linear, LMHead), "dense_gemm"),
    )
    for kind, cat in kinds:
        if isinstance(mod, kind):
            return cat
    from pdserve.layers.moe import DenseMLP

    return "dense_gemm" if isinstance(mod, DenseMLP) else None


@contextmanager
def module_scopes(model: Any) -> Iterator[None]:
    """Put a ``pdserve:<category>`` profiler range around every categorised module's
    forward while the context is open."""
    import torch

    stack: list[Any] = []
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any) -> None:
            rf = torch.autograd.profiler.record_function(SCOPE_PREFIX + name)
            rf.__enter__()
            stack.append(rf)

        return hook

    def leave(mod: Any, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for mod in model.modules():
        cat = module_category(mod)
        if cat is not None:
            handles.append(mod.register_forward_pre_hook(enter(cat)))
            handles.append(mod.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:  # a forward that raised
            stack.pop().__exit__(None, None, None)


@dataclass
class Span:
    """One kernel (or, on a CPU, one operator's self time) of a profiled step."""

    name: str
    start_us: float
    end_us: float
    category: str
    busy_us: float = -1.0  # time it counts (self time for a CPU operator), default: its span
    stream: int | None = None  # a device activity's stream (its waits are clipped)

    def __post_init__(self) -> None:
        if self.busy_us < 0:
            self.busy_us = self.end_us - self.start_us


def clip_waits(spans: list[Span]) -> list[Span]:
    """Each device activity counted from the end of the one before it on its stream.

    A kernel launched early (programmatic dependent launch: pdserve's Triton kernels on a
    Hopper GPU) starts while its predecessor still runs and first waits for it; the
    profiler's span includes that wait, which is the predecessor's work. So a span's time
    (``busy_us``) starts at the latest end of the activities started before it on the same
    stream. Spans without a stream keep their time. Returns ``spans``, updated."""
    last: dict[int, float] = {}
    for s in sorted(spans, key=lambda s: s.start_us):
        if s.stream is None:
            continue
        begin = max(s.start_us, last.get(s.stream, s.start_us))
        s.busy_us = max(0.0, s.end_us - begin)
        last[s.stream] = max(begin, s.end_us)
    return spans


@dataclass
class StepProfile:
    """One profiled step: its kernels in start order and the host wall time."""

    spans: list[Span]
    wall_ms: float
    device: str  # "cuda" (kernels) or "cpu" (operators' self time)
    notes: list[str] = field(default_factory=list)
    # how the kernels found their ranges (:func:`scope_diagnostics`), when profiled
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def table(self, top_n: int = 10) -> dict[str, Any]:
        """Time by category (ms, share of the device span, count), the idle gap, the
        span, and the ``top_n`` longest kernels (name, category, total ms, count)."""
        spans = self.spans
        cats: dict[str, dict[str, float]] = {c: {"ms": 0.0, "count": 0} for c in CATEGORIES}
        if not spans:
            return {"span_ms": 0.0, "wall_ms": self.wall_ms, "kernels": 0, "categories": cats,
                    GAP: {"ms": 0.0, "share": 0.0}, "top": [], "device": self.device,
                    "notes": self.notes}  # fmt: skip
        start = min(s.start_us for s in spans)
        end = max(s.end_us for s in spans)
        span_ms = (end - start) / 1e3
        for s in spans:
            c = cats.setdefault(s.category, {"ms": 0.0, "count": 0})
            c["ms"] += s.busy_us / 1e3
            c["count"] += 1
        # a CPU's operators nest (self times add up); kernels may overlap (union)
        busy = sum(s.busy_us for s in spans) / 1e3 if self.device == "cpu" else _union_ms(spans)
        gap = max(span_ms - busy, 0.0)
        for c in cats.values():
            c["share"] = c["ms"] / span_ms if span_ms else 0.0
        by_name: dict[tuple[str, str], list[float]] = {}
        for s in spans:
            by_name.setdefault((s.name, s.category), []).append(s.busy_us)
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
        return {
            "device": self.device,
            "wall_ms": self.wall_ms,
            "span_ms": span_ms,
            "kernels": len(spans),
            "categories": cats,
            GAP: {"ms": gap, "share": gap / span_ms if span_ms else 0.0},
            "top": [
                {"name": n[:120], "category": c, "ms": sum(v) / 1e3, "count": len(v)}
                for (n, c), v in top
            ],
            "notes": self.notes,
            "diagnostics": self.diagnostics,
        }


def scope_diagnostics(events: Any) -> dict[str, Any]:
    """How a capture's kernels found their categories' ranges: the ``pdserve:`` ranges
    by category (count, total ms, the longest, the threads they ran on), the device
    activities whose launching operator is missing, and those whose operator sits in no
    range. A range swallowing a whole step (its end lost) shows as a longest range near
    the span (run 51's 64K). ``outside_samples``: the first few kernels outside every range
    (on the GPU every kernel of runs 62-65 was), each with its launching operator's chain
    of parents, or, where no operator was found, its ids and the chain of the launch call
    that has its id (the runtime event); the chains show where the link breaks."""
    from torch.autograd import DeviceType

    ranges: dict[str, dict[str, float]] = {}
    threads: set[Any] = set()
    launches: dict[int, Any] = {}  # runtime calls (a CPU event with a link) by their id
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if getattr(e, "linked_correlation_id", 0):
            launches[e.id] = e
        if e.name.startswith(SCOPE_PREFIX):
            r = ranges.setdefault(e.name[len(SCOPE_PREFIX) :], {"count": 0, "ms": 0.0,
                                                                 "longest_ms": 0.0})  # fmt: skip
            ms = (e.time_range.end - e.time_range.start) / 1e3
            r["count"] += 1
            r["ms"] += ms
            r["longest_ms"] = max(r["longest_ms"], ms)
            threads.add(getattr(e, "thread", None))
    unlinked = unscoped = kernels = 0
    samples: list[dict[str, Any]] = []
    for dev, op in _device_activities(events):
        kernels += 1
        if op is None:
            unlinked += 1
            if len(samples) < 6:
                samples.append({"kernel": dev.name[:60],
                                "ids": [dev.id, getattr(dev, "linked_correlation_id", 0)],
                                "launch_chain": _chain(launches.get(dev.id))})  # fmt: skip
        elif _scope_of(op) is None:
            unscoped += 1
            if len(samples) < 6:
                samples.append({"kernel": dev.name[:60], "operator_chain": _chain(op)})
    return {"ranges": ranges, "device_activities": kernels, "without_operator": unlinked,
            "outside_ranges": unscoped, "outside_samples": samples,
            "range_threads": sorted(str(t) for t in threads)[:4]}  # fmt: skip


def _chain(e: Any) -> list[str]:
    """An event and its parents, innermost first: name, time range and thread."""
    chain: list[str] = []
    while e is not None and len(chain) < 8:
        t = e.time_range
        thread = getattr(e, "thread", None)
        where = f" t{thread}" if thread is not None else ""
        chain.append(f"{e.name[:60]} [{t.start:.0f}, {t.end:.0f}]{where}")
        e = e.cpu_parent
    return chain


def _union_ms(spans: list[Span]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s in sorted(spans, key=lambda s: s.start_us):
        if cur_e is None or s.start_us > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s.start_us, s.end_us
        else:
            cur_e = max(cur_e, s.end_us)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total / 1e3


def _scope_of(evt: Any) -> str | None:
    """The innermost ``pdserve:`` range around a CPU event (itself included)."""
    e = evt
    while e is not None:
        if e.name.startswith(SCOPE_PREFIX):
            return str(e.name[len(SCOPE_PREFIX) :])
        e = e.cpu_parent
    return None


def _annotation(e: Any) -> bool:
    kind = str(getattr(e, "activity_type", "") or "").lower()
    return bool(
        e.name.startswith(SCOPE_PREFIX)
        or getattr(e, "is_user_annotation", False)
        or "annotation" in kind
    )


def _device_activities(events: Any) -> Iterator[tuple[Any, Any]]:
    """Each device activity of ``prof.events()`` (kernels, copies, memsets; the device
    mirror of a range is none) with the CPU operator that launched it (None: not found)."""
    from torch.autograd import DeviceType

    by_id = {
        e.id: e
        for e in events
        if e.device_type == DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)
    }
    for e in events:
        if e.device_type == DeviceType.CUDA and not _annotation(e):
            yield e, by_id.get(getattr(e, "linked_correlation_id", 0))


def spans_from_events(events: Any, device: str) -> list[Span]:
    """The step's spans from ``prof.events()``: on CUDA every device activity (kernels,
    copies, memsets) with the category of the operator that launched it, its wait for the
    previous one left out (:func:`clip_waits`); on a CPU every operator's self time (ranges
    themselves and runtime calls left out)."""
    from torch.autograd import DeviceType

    out: list[Span] = []
    if device == "cpu":
        for e in events:
            if e.device_type != DeviceType.CPU or _annotation(e):
                continue
            if getattr(e, "linked_correlation_id", 0):
                continue
            s, t = e.time_range.start, e.time_range.end
            cat = categorize(e.name, _scope_of(e))
            out.append(Span(e.name, s, t, cat, busy_us=e.self_cpu_time_total))
    else:
        for e, op in _device_activities(events):
            scope = _scope_of(op) if op is not None else None
            cat = categorize(e.name, scope)
            stream = int(getattr(e, "device_resource_id", 0) or 0)
            out.append(Span(e.name, e.time_range.start, e.time_range.end, cat, stream=stream))
        clip_waits(out)
    out.sort(key=lambda s: s.start_us)
    return out


def profile_step(run: Callable[[], Any], model: Any | None, device: Any) -> StepProfile:
    """Profile one call of ``run`` (one engine step) on ``device``: CUDA activity on a GPU,
    operators on a CPU. With ``model`` its modules run inside category ranges."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(dev)
    scopes = module_scopes(model) if model is not None else _nothing()
    with profile(activities=acts) as prof, scopes:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize(dev)
        wall = (time.perf_counter() - t0) * 1e3
    kind = "cuda" if cuda else "cpu"
    events = prof.events()
    diag = scope_diagnostics(events) if model is not None else {}
    return StepProfile(spans_from_events(events, kind), wall, kind, diagnostics=diag)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def align_categories(graph: StepProfile, eager: StepProfile) -> int:
    """Give a graph replay's kernels the categories of the same kernels in an eager run of
    the captured forward, matched in order by name; the rest by the name's most common
    category in that run, else by the name rules. Returns how many were matched in order."""
    a = [s.name for s in eager.spans]
    b = [s.name for s in graph.spans]
    matched = 0
    done = [False] * len(b)
    if a == b:
        blocks = [difflib.Match(0, 0, len(a))]
    else:
        blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    for blk in blocks:
        for j in range(blk.size):
            graph.spans[blk.b + j].category = eager.spans[blk.a + j].category
            done[blk.b + j] = True
            matched += 1
    common: dict[str, str] = {}
    votes: dict[str, Counter[str]] = {}
    for s in eager.spans:
        votes.setdefault(s.name, Counter())[s.category] += 1
    for name, c in votes.items():
        common[name] = c.most_common(1)[0][0]
    for s, ok in zip(graph.spans, done, strict=True):
        if not ok:
            s.category = common.get(s.name) or categorize(s.name, None)
    graph.notes.append(f"{matched} of {len(b)} kernels matched in order to the eager run")
    return matched


def format_tables(columns: dict[str, dict[str, Any]]) -> str:
    """Side-by-side text table of :meth:`StepProfile.table` results (column name -> table):
    time by category, the idle gap, the kernels (device activities) of the step, its span."""
    names = list(columns)
    head = f"{'category':14s}" + "".join(f" | {n[:22]:>22s}" for n in names)
    lines = [head, "-" * len(head)]
    for cat in (*CATEGORIES, GAP):
        cells = []
        for n in names:
            t = columns[n]
            c = t[GAP] if cat == GAP else t["categories"].get(cat, {"ms": 0.0, "share": 0.0})
            cells.append(f" | {c['ms']:9.3f} ms {100 * c['share']:6.1f}%")
        lines.append(f"{cat:14s}" + "".join(cells))
    lines.append(f"{'kernels':14s}" + "".join(f" | {columns[n]['kernels']:22d}" for n in names))
    lines.append(
        f"{'span (wall)':14s}"
        + "".join(
            f" | {columns[n]['span_ms']:7.2f} ({columns[n]['wall_ms']:6.2f}) ms" for n in names
        )
    )
    return "\n".join(lines)
