"""The decode-size GEMM (kernels/skinny_gemm.py) in tensor-parallel layers, two gloo
ranks, the kernel in Triton's interpreter: column-parallel with the add+RMSNorm prologue
and row-parallel with the SiLU-and-mul prologue (its partial all-reduced) at one row, and
the same layers after their producers at three rows, against the single-process torch
layers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from _ranks import run_ranks
from _scripts import load_script
from pdserve.distributed import RankInfo, init_parallel_groups
from pdserve.kernels.reference import rms_norm, silu_and_mul_torch
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.linear import Linear, MergedLinear, norm_then_linear, silu_then_linear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear

HIDDEN, INTER = 32, 48


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # Triton's interpreter in this (spawned) process, with its fix, before any kernel
    # module is imported (the benchmarks' CPU mode)
    os.environ["TRITON_INTERPRET"] = "1"
    load_script("_interp").interpreter_fix()
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang_tensor, "_pdserve_fixed", False)
    groups = init_parallel_groups(RankInfo(tp_size=2, tp_rank=rank), init_file, torch.device("cpu"))
    tp = groups.tp
    gen = torch.Generator().manual_seed(0)
    parts = {"gate_proj": INTER, "up_proj": INTER}
    gate_up = MergedLinear(HIDDEN, parts)
    down = Linear(INTER, HIDDEN, bias=True)
    for p in (*gate_up.parameters(), *down.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pgu = MergedColumnParallelLinear(HIDDEN, parts, tp=tp)
    pdown = RowParallelLinear(INTER, HIDDEN, bias=True, tp=tp)
    half = INTER // 2
    g, u = gate_up.weight.data[:INTER], gate_up.weight.data[INTER:]
    pgu.weight.data.copy_(
        torch.cat([g[rank * half : (rank + 1) * half], u[rank * half : (rank + 1) * half]])
    )
    pdown.weight.data.copy_(down.weight.data[:, rank * half : (rank + 1) * half])
    pdown.bias.data.copy_(down.bias.data)  # type: ignore[union-attr]
    pgu.skinny_rows = pdown.skinny_rows = 16
    norm = RMSNorm(HIDDEN, 1e-5, torch.float32)
    norm.weight.data.copy_(torch.rand(HIDDEN, generator=gen) + 0.5)
    norm.fused = True
    act = SiluAndMul()
    out = {}
    for rows in (1, 3):  # the prologues folded in (one row), the producers first (three)
        x = torch.randn(rows, HIDDEN, generator=gen)
        res = torch.randn(rows, HIDDEN, generator=gen)
        z = x + res
        want = down(silu_and_mul_torch(gate_up(rms_norm(z, norm.weight, 1e-5))))
        h, s = norm_then_linear(norm, pgu, x, res)
        got = silu_then_linear(act, pdown, h)
        out[f"mlp{rows}"] = float((got - want).abs().max())
        out[f"residual{rows}"] = float((s - z).abs().max())
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    groups.destroy()


def test_tp_prologues_match_single_process(tmp_path: Path) -> None:
    for rank, res in enumerate(run_ranks(_worker, 2, tmp_path)):
        for rows in (1, 3):
            assert res[f"mlp{rows}"] < 1e-4 and res[f"residual{rows}"] == 0.0, (rank, res)
