"""Weight prefetch into L2 on a side stream, overlapping a decode step's latency-bound
kernels (see :mod:`pdserve.kernels.l2_prefetch` for why it pays).

Model code brackets the stretch to overlap::

    started = PREFETCH.start(self.o_proj.weight, num_tokens)
    ...   # RoPE, KV write, attention
    if started:
        PREFETCH.join()
    out = self.o_proj(out)

``start`` forks a side stream off the current one and launches the prefetch there;
``join`` makes the current stream wait for it. Inside CUDA-graph capture this records
a fork/join branch in the graph, so every replay overlaps the same way. It only runs
on CUDA, only for steps of at most ``max_tokens`` tokens (a prefill's GEMMs are
compute-bound and gain nothing), and never changes a result.

``PDSERVE_L2_PREFETCH``: ``auto`` (default; on for CUDA with the fused kernels), ``0``
(off), or ``1`` (on for CUDA even without them). ``PDSERVE_L2_PREFETCH_CTAS``: programs
of the prefetch kernel (default 32); ``PDSERVE_L2_PREFETCH_MAX_TOKENS`` (default 64).
"""

from __future__ import annotations

import os

import torch

from pdserve.layers.fused import use_fused_kernels


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer (got {raw!r})") from None
    if v < 1:
        raise ValueError(f"{name} must be a positive integer (got {raw!r})")
    return v


class WeightPrefetcher:
    def __init__(self, enabled: bool, num_ctas: int = 32, max_tokens: int = 64) -> None:
        self.enabled = enabled
        self.num_ctas = num_ctas
        self.max_tokens = max_tokens
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._sinks: dict[torch.device, torch.Tensor] = {}
        self._pending: torch.cuda.Stream | None = None

    @classmethod
    def from_env(cls) -> WeightPrefetcher:
        mode = os.environ.get("PDSERVE_L2_PREFETCH", "auto")
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"PDSERVE_L2_PREFETCH must be auto, 0 or 1 (got {mode!r})")
        enabled = mode == "1" or (mode == "auto" and use_fused_kernels("cuda"))
        return cls(
            enabled,
            _env_int("PDSERVE_L2_PREFETCH_CTAS", 32),
            _env_int("PDSERVE_L2_PREFETCH_MAX_TOKENS", 64),
        )

    mode = "load"

    def configure(self, enabled: bool, num_ctas: int, max_tokens: int, mode: str = "load") -> None:
        """Change the settings (benchmarks compare them); graphs captured before keep the
        behaviour they were captured with."""
        self.enabled, self.num_ctas, self.max_tokens = enabled, num_ctas, max_tokens
        self.mode = mode
        self._sinks.clear()

    def start(self, weight: torch.Tensor, num_tokens: int) -> bool:
        """Launch the prefetch of ``weight`` on the side stream; False when it does not
        apply (off, not CUDA, too many tokens), and then :meth:`join` must not be called."""
        if not self.enabled or weight.device.type != "cuda" or num_tokens > self.max_tokens:
            return False
        if self._pending is not None:
            raise RuntimeError("a weight prefetch is already in flight; join it first")
        from pdserve.kernels.l2_prefetch import l2_prefetch

        dev = weight.device
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(dev)
        sink = self._sinks.get(dev)
        if sink is None or sink.numel() != self.num_ctas:
            sink = self._sinks[dev] = torch.zeros(self.num_ctas, dtype=torch.int32, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            if self.mode == "load":
                l2_prefetch(weight, sink)
            else:
                from pdserve.kernels.l2_prefetch import l2_prefetch_issue

                l2_prefetch_issue(weight, sink, bulk=self.mode == "bulk")
        self._pending = side
        return True

    def join(self) -> None:
        if self._pending is None:
            raise RuntimeError("no weight prefetch in flight")
        torch.cuda.current_stream(self._pending.device).wait_stream(self._pending)
        self._pending = None


PREFETCH = WeightPrefetcher.from_env()
