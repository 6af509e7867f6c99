"""Device launches of a graph-shaped decode step (issue 30), counted on the CPU with the
CUDA code paths selected (the Triton backends and fused kernels, under the interpreter
here): the counter itself, and per-layer budgets for the tiny GLM-5 and Llama, so a
change that adds kernels to the decode path fails here before it costs GPU time."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from torch import nn

from pdserve.models import load_model
from pdserve.profiling.launch_count import LaunchCounter, decode_step_launches, format_table
from pdserve.testing.checkpoint import make_checkpoint


@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * 2, mask=offs < n)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x.view(2, 4)).t().contiguous()  # mm, then a copy (t is a view)
        z = y[:, :2].unsqueeze(0).expand(3, -1, -1)  # views only
        y[0, :0].zero_()  # empty: launches nothing
        _double_kernel[(1,)](y, y.numel(), BLOCK=16)  # one Triton launch, whatever it moves
        return z + 1


def test_counter_counts_kernels_not_views(device: torch.device) -> None:
    model = _Toy().to(device)
    x = torch.ones(8, device=device)
    with torch.no_grad(), LaunchCounter(model) as counter:
        model(x)
    got = [(x.kind, x.name, x.module) for x in counter.counts.launches]
    assert got == [
        ("aten", "mm", "inner"),
        ("aten", "clone", ""),
        ("triton", "_double_kernel", ""),
        ("aten", "add", ""),
    ]
    assert not counter.counts.syncs
    x.sum().item()  # outside the counter: not seen
    with LaunchCounter() as counter:
        x.sum().item()
    assert [s.name for s in counter.counts.syncs] == ["_local_scalar_dense"]


def _model(
    arch: str, tmp: Path, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> nn.Module:
    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "1")
    monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "16")  # Llama's decode-size GEMM and prologues
    overrides = {"num_hidden_layers": 2} if arch == "GlmMoeDsaForCausalLM" else None
    ckpt = make_checkpoint(arch, "tiny", tmp, config_only=True, config_overrides=overrides)
    model, _ = load_model(ckpt, "bfloat16", device, load_format="dummy")
    return model


# per decoder layer, the most launches a graph-shaped decode step may issue, by submodule
# (the rest of the layer: "total"); GLM-5's dense first layer, its MoE layers, and Llama's.
# Before issue 30: 65 / 100 / 10 (GLM-5's RoPE gathers, the rotation's torch ops, the
# indexer's cache write, fills and casts, the MoE alignment's ~20 torch ops).
_GLM_ATTN = {
    "input_layernorm": 1,  # the residual add fused in
    "self_attn": 1,  # q_pe RoPE + latent norm + k_pe RoPE + latent-cache write
    "self_attn.indexer": 6,  # wq_b, wk, weights_proj, prep (RoPE, norm, write), score, select
    "self_attn.attn": 3,  # W_UK, sparse MLA (+ its split combine on a GPU), W_UV
}
BUDGETS: dict[str, dict[int, dict[str, int]]] = {
    "GlmMoeDsaForCausalLM": {
        0: {**_GLM_ATTN, "total": 20},
        # router GEMM + its input cast + selection; alignment, gate/up, down, combine
        1: {**_GLM_ATTN, "mlp.gate": 3, "mlp.experts": 4, "mlp": 0, "total": 27},
    },
    "LlamaForCausalLM": {
        # the two norms, q|k|v, RoPE + K/V write, decode, o, gate|up, and the MLP's
        # SiLU-and-mul + down in one launch: the decode-size GEMM's prologue (9 a layer
        # before)
        i: {"self_attn.attn": 2, "self_attn": 0, "self_attn.o_proj": 1, "mlp": 1, "total": 8}
        for i in (0, 1)
    },
}


@pytest.mark.parametrize("arch", sorted(BUDGETS))
def test_decode_launches_per_layer_within_budget(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    model = _model(arch, tmp_path, monkeypatch, device)
    counts = decode_step_launches(model, batch=1, context=32, width=64)
    table = format_table(counts)
    assert not counts.syncs, table  # a graph-shaped step never waits on the device
    per = counts.per_layer()
    assert sorted(per) == sorted(BUDGETS[arch]), table
    for layer, budget in BUDGETS[arch].items():
        got: Counter[str] = per[layer]
        assert sum(got.values()) <= budget["total"], f"layer {layer}\n{table}"
        for name, most in budget.items():
            if name != "total":
                assert got.get(name, 0) <= most, f"layer {layer} {name}\n{table}"
    assert sum(counts.outside_layers().values()) <= 4, table  # embedding, final norm, head
    # a batch of 8 launches the same kernels (the MoE alignment: one program still), but
    # for Llama's SiLU-and-mul: it folds into the decode-size GEMM's launch at one row
    # only (skinny_gemm.prologue_pays)
    batch8 = decode_step_launches(model, batch=8, context=32, width=64)
    unfolded = len(per) if arch == "LlamaForCausalLM" else 0
    assert batch8.total == counts.total + unfolded and not batch8.syncs, format_table(batch8)


def test_launch_count_script_writes_its_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/launch_count.py's smoke run on the tiny Llama: on the CPU under the
    interpreter; on a CUDA machine on the device (the kernel modules were compiled for it
    before the script could set the interpreter), which also runs its profiled count."""
    from _scripts import load_script

    monkeypatch.setenv("PDSERVE_FUSED_KERNELS", "1")  # restored after (the script sets it)
    monkeypatch.setenv("PDSERVE_SKINNY_ROWS", "16")  # the budgets' decode-size GEMM
    bench = load_script("launch_count")
    out = tmp_path / "launches.json"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--out", str(out), "--points", "llama=tiny", "--batch", "1", "--device", device,
            "--context", "32", "--width", "64"]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    (m,) = res["models"]
    assert m["arch"] == "LlamaForCausalLM" and m["layers"] == 2 and not m["syncs"]
    assert (m["profiled"] is not None) == (device == "cuda")
    assert sum(m["per_layer"]["0"].values()) <= BUDGETS[m["arch"]][0]["total"]
    assert m["total"] == sum(sum(c.values()) for c in m["per_layer"].values()) + sum(
        m["outside_layers"].values()
    )
    assert "layer total" in capsys.readouterr().out
