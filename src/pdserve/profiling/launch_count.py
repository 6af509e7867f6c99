"""How many device launches one decode step issues, counted on any machine.

A decode step at low batch is a chain of small kernels, so their number (and the idle
time between them) sets its speed. This counts them without a GPU: the model runs its
CUDA code paths (the Triton attention backends and fused kernels; on a CPU under
Triton's interpreter, ``TRITON_INTERPRET=1``, with ``PDSERVE_FUSED_KERNELS=1``) inside
:class:`LaunchCounter`, which records

- every aten operator that launches a kernel on CUDA, seen through a
  ``TorchDispatchMode`` (after composite operators decompose: ``F.linear`` is one
  ``mm``/``addmm``, ``einsum`` its ``bmm`` plus any copies it makes). Operators that only
  make a view or allocate (:data:`NO_LAUNCH`) and operators whose every output is empty
  launch nothing and are not counted. Each other operator counts one launch: a few
  launch several on CUDA (:data:`MULTI_KERNEL`: sorts, cumulative sums, radix top-k;
  cuBLAS may add a split-K reduction), so the count is a floor for those;
- every Triton kernel launch (``kernel[grid](...)``, compiled or interpreted); the aten
  operators the interpreter runs to move a launch's arguments are not counted;
- host synchronisations (``.item()``, ``.tolist()``, ``nonzero``...): a graph-shaped
  step must have none.

Each launch is attributed to the innermost module running it (forward hooks), so the
result reads per decoder layer and, inside a layer, per submodule.

:func:`decode_step_launches` runs one graph-shaped decode step: ``batch`` requests of
one token each over ``context`` cached tokens, with the metadata a CUDA graph is
captured with (``max_seq_len`` = the captured ``width``), the forward and the LM head
(what ``runner/cuda_graph.py`` captures). ``benchmarks/launch_count.py`` prints the
table for a preset; ``tests/kernels/test_launch_count.py`` holds the per-layer budgets.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# aten overload packets that make views or allocate: no kernel
NO_LAUNCH = frozenset(
    {
        "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "permute",
        "expand", "slice", "select", "split", "split_with_sizes", "unbind", "chunk",
        "as_strided", "unsqueeze", "squeeze", "detach", "alias", "narrow", "diagonal",
        "unfold", "view_as_real", "view_as_complex", "lift_fresh", "empty", "empty_like",
        "empty_strided", "new_empty", "new_empty_strided", "_to_dense", "conj",
        "resolve_conj", "resolve_neg", "_neg_view", "_conj", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset", "dim", "is_same_size", "result_type",
        "scalar_tensor",  # torch.where's wrapped scalar: a CPU tensor, no launch
    }
)  # fmt: skip
# ops that read a device value on the host
SYNC = frozenset({"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "unique",
                  "_unique2", "masked_select", "repeat_interleave_tensor"})  # fmt: skip
# ops that launch more than one kernel on CUDA (counted once here)
MULTI_KERNEL = frozenset({"sort", "argsort", "topk", "cumsum", "bincount", "kthvalue"})


@dataclass(frozen=True)
class Launch:
    kind: str  # "aten" or "triton"
    name: str  # aten overload packet or Triton kernel name
    stack: tuple[str, ...]  # the paths of the modules running, outermost first

    @property
    def module(self) -> str:
        """The innermost module's path ("" outside the model's modules)."""
        return self.stack[-1] if self.stack else ""


@dataclass
class LaunchCounts:
    launches: list[Launch] = field(default_factory=list)
    syncs: list[Launch] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.launches)

    def multi_kernel(self) -> Counter[str]:
        """Launches counted once here that are several kernels on CUDA, by op."""
        return Counter(x.name for x in self.launches if x.name in MULTI_KERNEL)

    def per_layer(self, prefix: str = "model.layers.") -> dict[int, Counter[str]]:
        """Layer index -> launches by submodule (the layer-relative path, two levels deep:
        ``self_attn.indexer``, ``mlp.gate``; a launch of the layer itself is ``(self)``).
        A module outside the layer that the layer calls (the shared rotary embedding)
        counts for its caller."""
        out: dict[int, Counter[str]] = {}
        pat = re.compile(re.escape(prefix) + r"(\d+)(?:\.(.*))?$")
        for x in self.launches:
            inner = [m for m in map(pat.match, x.stack) if m is not None]
            if not inner:
                continue
            m = inner[-1]
            rel = m.group(2) or "(self)"
            out.setdefault(int(m.group(1)), Counter())[".".join(rel.split(".")[:2])] += 1
        return out

    def outside_layers(self, prefix: str = "model.layers.") -> Counter[str]:
        """Launches outside every decoder layer, by module (embedding, final norm, head)."""
        return Counter(
            x.module or "(top)"
            for x in self.launches
            if not any(p.startswith(prefix) for p in x.stack)
        )

    def by_name(self, module_prefix: str = "") -> Counter[str]:
        return Counter(
            f"{x.kind}:{x.name}"
            for x in self.launches
            if any(p.startswith(module_prefix) for p in x.stack) or not module_prefix
        )


class LaunchCounter(TorchDispatchMode):
    """Context manager recording launches into :attr:`counts` (see the module doc)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.counts = LaunchCounts()
        self._model = model
        self._stack: list[str] = []
        self._in_triton = 0
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, Any]] = []

    @property
    def _where(self) -> tuple[str, ...]:
        return tuple(self._stack)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._in_triton:
            return out
        name = func._overloadpacket.__name__
        if name in SYNC:
            self.counts.syncs.append(Launch("aten", name, self._where))
            return out
        if name in NO_LAUNCH or _all_empty(out):
            return out
        self.counts.launches.append(Launch("aten", name, self._where))
        return out

    # -- module attribution and Triton launches -------------------------------------------
    def __enter__(self) -> LaunchCounter:
        if self._model is not None:
            for path, mod in self._model.named_modules():
                self._handles.append(mod.register_forward_pre_hook(self._push(path)))
                self._handles.append(mod.register_forward_hook(self._pop))
        self._patch_triton()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for cls, run in self._patched:
            cls.run = run
        self._patched.clear()

    def _push(self, path: str) -> Any:
        def hook(mod: nn.Module, args: Any) -> None:
            self._stack.append(path)

        return hook

    def _pop(self, mod: nn.Module, args: Any, out: Any) -> None:
        self._stack.pop()

    def _patch_triton(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        counter = self
        for cls in (JITFunction, InterpretedFunction):
            orig = cls.run

            def run(self: Any, *args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
                if kwargs.get("warmup"):
                    return _orig(self, *args, **kwargs)
                name = getattr(getattr(self, "fn", None), "__name__", "triton")
                counter.counts.launches.append(Launch("triton", name, counter._where))
                counter._in_triton += 1
                try:
                    return _orig(self, *args, **kwargs)
                finally:
                    counter._in_triton -= 1

            self._patched.append((cls, orig))
            cls.run = run


def _all_empty(out: Any) -> bool:
    """Whether every tensor ``out`` holds is empty (CUDA launches nothing for those)."""
    ts = [out] if isinstance(out, torch.Tensor) else [o for o in _flat(out)]
    ts = [t for t in ts if isinstance(t, torch.Tensor)]
    return bool(ts) and all(t.numel() == 0 for t in ts)


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


# ------------------------------------------------------------------------ a decode step
def decode_metadata(
    batch: int, context: int, width: int, block_size: int, device: torch.device
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(common metadata, block tables, positions) of a uniform decode step: request ``b``
    has ``context`` cached tokens and adds one, in blocks ``1 + b * per_req ...``; the
    host ``max_seq_len`` is the captured ``width`` (as a graph is captured)."""
    from pdserve.layers.attention.backend import CommonAttentionMetadata

    if context + 1 > width:
        raise ValueError(f"context {context} + 1 does not fit the width {width}")
    per_req = -(-width // block_size)
    bt = (1 + torch.arange(batch * per_req, dtype=torch.int32)).view(batch, per_req)
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = bt[:, context // block_size].long() * block_size + context % block_size

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    common = CommonAttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=width,
        block_size=block_size,
        query_start_loc=dev(torch.arange(batch + 1, dtype=torch.int32)),
        seq_lens=dev(torch.full((batch,), context + 1, dtype=torch.int32)),
        block_tables=dev(bt),
        slot_mapping=dev(slots),
        token_req_idx=dev(torch.arange(batch, dtype=torch.int64)),
        token_q_idx=dev(torch.zeros(batch, dtype=torch.int64)),
    )
    return common, bt, pos


def decode_step(
    model: Any,
    batch: int = 1,
    context: int = 32,
    width: int = 64,
    block_size: int = 16,
    backend: str = "triton",
) -> Callable[[], torch.Tensor]:
    """A callable running one graph-shaped decode step of ``model`` (forward and LM head;
    returns the logits) with the ``backend`` attention backends, over fresh zeroed caches
    (each call writes the same slots again)."""
    from pdserve.forward_context import KVCaches, set_forward_context
    from pdserve.runner.model_step import collect_cache_layers

    p = next(model.parameters())
    device = p.device
    cfg, layers = collect_cache_layers(model, block_size, str(p.dtype).removeprefix("torch."))
    owners: dict[str, Any] = {g: mods[0] for g, mods in layers.items()}
    backends = {g: o.make_backend(backend, device, width) for g, o in owners.items()}
    common, bt, pos = decode_metadata(batch, context, width, block_size, device)
    caches = KVCaches.allocate(cfg, 1 + bt.numel(), device)
    md = {g: b.build_metadata(common) for g, b in backends.items()}
    ids = torch.ones(batch, dtype=torch.int64, device=device)
    pos = pos.to(device)

    def run() -> torch.Tensor:
        # no_grad, not inference_mode: composite operators (linear, einsum) must decompose
        # before a dispatch mode sees them (inference mode skips the autograd key that
        # decomposes them)
        with torch.no_grad(), set_forward_context(backends, md, caches):
            return model.compute_logits(model(ids, pos))

    return run


def decode_step_launches(
    model: Any,
    batch: int = 1,
    context: int = 32,
    width: int = 64,
    block_size: int = 16,
    backend: str = "triton",
) -> LaunchCounts:
    """Launches of one graph-shaped decode step (:func:`decode_step`)."""
    run = decode_step(model, batch, context, width, block_size, backend)
    if next(model.parameters()).is_cuda:
        run()  # compile the Triton kernels outside the count
    with LaunchCounter(model) as counter:
        run()
    return counter.counts


def layer_table(counts: LaunchCounts) -> tuple[list[str], dict[int, Counter[str]]]:
    """(submodule names in first-seen order, per-layer counters) for printing."""
    per = counts.per_layer()
    names: list[str] = []
    for c in per.values():
        names += [n for n in c if n not in names]
    return names, per


def format_table(counts: LaunchCounts) -> str:
    """Launches per decoder layer by submodule, plus the step's total and what runs
    outside the layers."""
    names, per = layer_table(counts)
    layers = sorted(per)
    head = f"{'submodule':26s}" + "".join(f"{'L' + str(i):>6s}" for i in layers)
    lines = [head, "-" * len(head)]
    for n in names:
        lines.append(f"{n:26s}" + "".join(f"{per[i].get(n, 0):6d}" for i in layers))
    lines.append(f"{'layer total':26s}" + "".join(f"{sum(per[i].values()):6d}" for i in layers))
    outside = counts.outside_layers()
    lines.append(f"outside the layers: {sum(outside.values())} ({dict(outside)})")
    lines.append(f"step total: {counts.total}; host syncs: {len(counts.syncs)}")
    multi = counts.multi_kernel()
    if multi:
        lines.append(f"counted once, several kernels on CUDA: {dict(multi)}")
    return "\n".join(lines)
