"""Triton kernel variants pdserve has compiled in this process, to check that traffic
compiled none after start-up: a compile under traffic stalls a step by 0.1-0.5 s (H100
run 86: one at batch 1 made an MTP point 1.61x slower than no speculation). A benchmark
snapshots them before its timed window and reports the variants compiled in it; the
warm-start GPU test does the same around its requests.

Under the Triton interpreter nothing is compiled (every count is 0).
"""

from __future__ import annotations

import importlib
import pkgutil


def compiled_variants() -> dict[str, set]:
    """Compiled specialisations (their cache keys) of every Triton kernel of
    ``pdserve.kernels``, by ``module.kernel``. Triton is imported here, not at module
    level, so a test module importing this is safe to collect before the kernel tests
    set the interpreter up."""
    from triton.runtime.jit import JITFunction

    import pdserve.kernels

    out: dict[str, set] = {}
    for mod in pkgutil.iter_modules(pdserve.kernels.__path__):
        m = importlib.import_module(f"pdserve.kernels.{mod.name}")
        for name, obj in vars(m).items():
            if isinstance(obj, JITFunction):
                out[f"{mod.name}.{name}"] = {k for c in obj.device_caches.values() for k in c[0]}
    return out


def new_variants(before: dict[str, set], after: dict[str, set]) -> dict[str, list[str]]:
    """The variants in ``after`` and not in ``before``, by kernel (kernels with none left
    out)."""
    new = {k: sorted(map(str, v - before.get(k, set()))) for k, v in after.items()}
    return {k: v for k, v in new.items() if v}
