"""The benchmark scripts (benchmarks/*.py) as modules, for their CPU smoke tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported once under ``name`` (so dataclasses find their
    module, and a script importing another, as fp8_bench imports gpu_suite, shares it)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(
        BENCHMARKS / f"{name}.py"
    ):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
