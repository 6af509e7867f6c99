"""The sparse MLA prefill kernel alone, on the operands the model gave it (issue 26).

In run 62 the kernel took 12.4 ms a layer of the model's 16K prefill, and 11.1-11.2 ms in
the kernel sweep on synthetic operands (run 65, also in the model's layouts). To tell
what the data costs (the indexer's real selections) from what the surroundings cost (the
L2 contents and the clocks the other kernels leave behind), :func:`capture` keeps the
operands of one layer's call during a prefill and :func:`time_alone` times that call by
itself; ``glm5_bench.py --sections prefill`` reports both beside the in-model time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.profiling.prefill_flops import mla_pair_flops


def capture(cls: type, run: Callable[[], object], call: int = 0) -> tuple[Any, tuple] | None:
    """Run ``run`` with ``cls._prefill`` spied on: (backend, operands cloned before the
    call) of its call number ``call`` (one per attention layer and step); None when it
    was called fewer times."""
    orig = cls._prefill
    seen = 0
    got: list[tuple[Any, tuple]] = []

    def spy(self: Any, *args: Any) -> Any:
        nonlocal seen
        if seen == call:
            got.append((self, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)))
        seen += 1
        return orig(self, *args)

    cls._prefill = spy  # type: ignore[method-assign]
    try:
        run()
    finally:
        cls._prefill = orig  # type: ignore[method-assign]
    return got[0] if got else None


def time_alone(backend: Any, args: tuple, reps_ms: int = 200) -> dict[str, float]:
    """Median ms of ``backend._prefill(*args)`` called alone (``args`` as the backend takes
    them: q_lat, q_pe, cache, rows, ncand, scale, tokens, out), its (query, key) pairs and
    its matrix FLOPs (``pairs * prefill_flops.mla_pair_flops``)."""
    q_lat, q_pe, ncand, t = args[0], args[1], args[4], args[6]

    def call() -> None:
        backend._prefill(*args)

    if q_lat.device.type == "cuda":
        import triton

        ms = float(triton.testing.do_bench(call, warmup=5, rep=reps_ms, return_mode="median"))
    else:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
    pairs = int(ncand[:t].sum())
    heads, lat, rope = q_lat.shape[1], q_lat.shape[2], q_pe.shape[2]
    flop = float(pairs * mla_pair_flops(heads, lat, rope))
    return {"ms": ms, "pairs": float(pairs), "flop": flop}
