"""Standalone ``--device cpu`` smoke runs of the kernel benchmarks: Triton 3.6's
interpreter needs the NumPy >= 2.3 fix that tests/kernels/conftest.py applies (under
pytest it is already applied, and applying it again is a no-op)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

CONFTEST = Path(__file__).resolve().parents[1] / "tests" / "kernels" / "conftest.py"


def interpreter_fix() -> None:
    try:
        spec = importlib.util.spec_from_file_location("_pdserve_kernels_conftest", CONFTEST)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except Exception as e:  # no tests tree or no pytest: the interpreter may still work
        print(f"interpreter fix not applied: {type(e).__name__}: {e}", flush=True)


def bench_device(name: str) -> Any:
    """The ``torch.device`` of a benchmark's ``--device``: ``cpu`` turns on Triton's
    interpreter (with the fix above), ``cuda`` needs a GPU (None, said on stderr, when
    there is none)."""
    import torch

    if name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        interpreter_fix()
    elif not torch.cuda.is_available():
        print("no CUDA device; use --device cpu for the smoke mode", file=sys.stderr)
        return None
    return torch.device(name)
