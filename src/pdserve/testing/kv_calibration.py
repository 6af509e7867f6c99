"""Calibrated FP8 KV cache scales for a checkpoint (``make-checkpoint --kv-cache-scales``).

A short float32 forward (a few random prompts, the torch attention backends, CPU is
fine for the small presets) over the checkpoint's own weights records, per attention
layer, the largest |K| and |V| written to its cache (MLA: the largest value of its latent
row, latent and rotated key together); each scale is ``amax / 448`` (never below
:data:`~pdserve.layers.attention.kv_scale.MIN_KV_SCALE`), so the largest value seen lands
on e4m3's largest. MTP layers, where the model has them, are run too (their caches are
scaled like the target's). The scales go into
:data:`~pdserve.models.kv_scales.KV_SCALES_FILE` beside the weights, as float32 scalars
named ``<attention module>.k_scale`` / ``.v_scale`` (MLA: ``k_scale`` only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from pdserve.forward_context import KVCaches, set_forward_context
from pdserve.kernels.reference import FP8_MAX
from pdserve.layers.attention import Attention, CommonAttentionMetadata
from pdserve.layers.attention.kv_scale import MIN_KV_SCALE
from pdserve.layers.attention.mla import MLAAttention
from pdserve.models import load_model
from pdserve.models.hf_config import load_hf_config
from pdserve.models.kv_scales import KV_SCALES_FILE
from pdserve.models.registry import get_model_class
from pdserve.runner.model_step import collect_cache_layers

NUM_PROMPTS = 4
PROMPT_LEN = 48
_BLOCK = 16


def _metadata(n: int, device: torch.device) -> CommonAttentionMetadata:
    """One request of ``n`` new tokens on blocks 1.. (block 0 is the null block)."""
    nblk = -(-n // _BLOCK)
    return CommonAttentionMetadata(
        num_reqs=1,
        num_actual_tokens=n,
        max_query_len=n,
        max_seq_len=n,
        block_size=_BLOCK,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(1, nblk + 1, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(_BLOCK, _BLOCK + n, device=device),
        token_req_idx=torch.zeros(n, dtype=torch.int64, device=device),
        token_q_idx=torch.arange(n, device=device),
    )


class _AmaxRecorder:
    """Forward pre-hooks on every scalable cache owner: the running max |K|, |V| it is
    given (MLA: of its latent and rotated key, under K)."""

    def __init__(self, model: nn.Module) -> None:
        self.amax: dict[str, list[float]] = {}  # checkpoint module name -> [k, v]
        self.single: set[str] = set()
        self.handles: list[Any] = []
        for path, mod in model.named_modules():
            if isinstance(mod, Attention | MLAAttention):
                name = path.rpartition(".")[0]  # the attention module the checkpoint names
                self.amax[name] = [0.0, 0.0]
                if isinstance(mod, MLAAttention):
                    self.single.add(name)
                self.handles.append(mod.register_forward_pre_hook(self._hook(name, mod)))

    def _hook(self, name: str, mod: nn.Module) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def record(_: nn.Module, args: tuple[Any, ...]) -> None:
            # Attention(q, k, v); MLAAttention(q_nope, q_pe, latent, k_pe, kv_b_weight, topk)
            if isinstance(mod, MLAAttention):
                k = torch.cat([args[2].flatten(), args[3].flatten()])
                v = k
            else:
                k, v = args[1], args[2]
            seen = self.amax[name]
            seen[0] = max(seen[0], float(k.abs().max()))
            seen[1] = max(seen[1], float(v.abs().max()))

        return record

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def scales(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (k, v) in sorted(self.amax.items()):
            out[f"{name}.k_scale"] = _scale(k)
            if name not in self.single:
                out[f"{name}.v_scale"] = _scale(v)
        return out


def _scale(amax: float) -> torch.Tensor:
    return torch.tensor(max(amax / FP8_MAX, MIN_KV_SCALE), dtype=torch.float32)


def calibrate_kv_scales(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    num_prompts: int = NUM_PROMPTS,
    prompt_len: int = PROMPT_LEN,
) -> dict[str, torch.Tensor]:
    """The checkpoint's FP8 KV cache scales, by tensor name (see the module docstring);
    ``load_format="dummy"`` calibrates the weights a ``--config-only`` directory stands
    for (drawn from ``seed``)."""
    config = load_hf_config(model_dir)
    mtp = bool(getattr(get_model_class(config), "has_mtp", False)) and bool(
        config.raw.get("num_nextn_predict_layers")
    )
    options: dict[str, Any] = {"with_mtp": True} if mtp else {}
    dev = torch.device(device)
    model, _ = load_model(model_dir, "float32", dev, load_format=load_format, seed=seed, **options)
    n = max(2, min(prompt_len, int(config.max_position_embeddings)))
    cfg, layers = collect_cache_layers(model, _BLOCK, "float32")
    backends = {g: mods[0].make_backend("torch", dev, n) for g, mods in layers.items()}  # type: ignore[operator]
    caches = KVCaches.allocate(cfg, -(-n // _BLOCK) + 1, dev)
    common = _metadata(n, dev)
    md = {g: b.build_metadata(common) for g, b in backends.items()}
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(n, device=dev)
    recorder = _AmaxRecorder(model)
    try:
        with torch.inference_mode():
            for _ in range(num_prompts):
                ids = torch.randint(0, int(config.vocab_size), (n,), generator=gen).to(dev)
                with set_forward_context(backends, md, caches):
                    hidden = model(ids, positions)
                    for step in range(len(getattr(model, "mtp_layers", []))):
                        model.mtp_hidden(ids.roll(-1), positions, hidden, step)  # type: ignore[operator]
    finally:
        recorder.close()
    return recorder.scales()


def write_kv_scales(model_dir: str | Path, scales: dict[str, torch.Tensor]) -> Path:
    """Save ``scales`` as :data:`KV_SCALES_FILE` in ``model_dir``; returns its path."""
    path = Path(model_dir) / KV_SCALES_FILE
    save_file({k: v.contiguous().cpu() for k, v in scales.items()}, path, {"format": "pt"})
    return path
