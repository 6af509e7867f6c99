"""Multi-process tests over gloo on the CPU: spawn the ranks, collect what each saved."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], nprocs: int, out_dir: Path, *args: Any) -> list[Any]:
    """Run ``worker(rank, init_file, out_dir, *args)`` in ``nprocs`` spawned processes
    (``init_file``: a fresh file rendezvous); each saves its results to
    ``out_dir / f"{rank}.pt"``. Returns them in rank order."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            worker, args=(os.path.join(d, "init"), str(out_dir), *args), nprocs=nprocs,
            start_method="spawn",
        )  # fmt: skip
    return [torch.load(out_dir / f"{rank}.pt") for rank in range(nprocs)]
