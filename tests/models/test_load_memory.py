"""The memory a model that ends up FP8 takes while it loads: its linears are never
allocated in the model dtype (they are built on the meta device and replaced by FP8
layers before anything is allocated for them), so the peak is the FP8 model plus the
tensor being converted, well below the bf16 model.

Allocations are counted from the PyTorch profiler's CPU memory events (every allocation
and free of a CPU storage, in order), not from RSS. safetensors maps each file it opens
as one storage of the file's size (a private file mapping, read lazily: page cache, not
allocated memory); those are left out."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pdserve.models import load_model
from pdserve.testing.checkpoint import make_checkpoint

# Llama, linear-heavy: 16 layers of 512 KiB-ish linears, a small vocabulary
SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)
LARGEST = 512 * 256  # elements of the largest checkpoint tensor (gate_proj, up_proj)


def _allocated(fn: Callable[[], Any], files: Path | None = None) -> tuple[Any, int, int]:
    """(fn(), the most bytes held at once while it ran, the bytes still held after),
    leaving out the mappings of the safetensors files in ``files``."""
    mapped = {f.stat().st_size for f in files.glob("*.safetensors")} if files else set()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and abs(e.nbytes()) not in mapped
    ]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    assert events, "the profiler reported no allocation"
    return out, peak, held


def _bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(bfloat16, FP8) checkpoints of the same values."""
    bf16, fp8 = (tmp_path_factory.mktemp(n) for n in ("bf16", "fp8"))
    make_checkpoint("LlamaForCausalLM", "tiny", bf16, 1, "bfloat16", config_overrides=SHAPE)
    make_checkpoint(
        "LlamaForCausalLM", "tiny", fp8, 1, "bfloat16", config_overrides=SHAPE, quantization="fp8"
    )
    return bf16, fp8


@pytest.mark.parametrize("how", ["fp8 checkpoint", "quantized at load", "dummy"])
def test_fp8_load_peak_is_the_fp8_model_not_the_bf16_one(
    checkpoints: tuple[Path, Path], how: str
) -> None:
    bf16, fp8 = checkpoints
    plain, _ = load_model(bf16, "auto")
    plain_bytes = _bytes(plain)
    del plain
    source, load = {
        "fp8 checkpoint": (fp8, lambda: load_model(fp8, "auto")),
        "quantized at load": (bf16, lambda: load_model(bf16, "auto", quantization="fp8")),
        "dummy": (None, lambda: load_model(fp8, "auto", load_format="dummy", seed=1)),
    }[how]
    (model, _), peak, held = _allocated(load, source)
    fp8_bytes = _bytes(model)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert fp8_bytes < 0.6 * plain_bytes  # the linears halve; embeddings and head stay bf16
    assert abs(held - fp8_bytes) < 0.05 * fp8_bytes  # what stays is the model: all counted
    # one tensor converted at a time: its float32 working copies, a few times its size
    assert peak < fp8_bytes + 24 * LARGEST, (peak, fp8_bytes)
    assert peak < 0.75 * plain_bytes, (peak, plain_bytes)  # building it bf16 first: >= 1.0


def test_plain_load_allocates_the_model_once(checkpoints: tuple[Path, Path]) -> None:
    """Deferring the linears changes nothing for a model that stays bf16 (dummy too)."""
    bf16 = checkpoints[0]
    for fmt in ("auto", "dummy"):
        (model, _), peak, held = _allocated(lambda: load_model(bf16, load_format=fmt), bf16)  # noqa: B023
        size = _bytes(model)
        assert abs(held - size) < 0.05 * size and peak < size + 24 * LARGEST
