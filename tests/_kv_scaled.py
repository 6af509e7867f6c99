"""Checkpoints whose cached K/V (or MLA latent rows) run far beyond fp8's +-448, and the
decode logits of a model over a float32 or an fp8 cache.

:func:`loud_kv_checkpoint` copies a tiny checkpoint with every attention layer's K and V
multiplied by ``factor`` and the reads compensated (Q and ``o_proj`` divided by it; for
MLA the latent norm and rotated-key rows up, ``kv_b_proj`` and the query's rope rows
down), so the float model computes the same function, and stores the calibrated scales
in ``model.safetensors`` under the ModelOpt names (``<attn>.k_scale``/``.v_scale``).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from _attn_helper import PagedKV
from pdserve.forward_context import KVCaches
from pdserve.layers.attention.kv_scale import FP8CacheScales
from pdserve.models.hf_config import load_hf_config
from pdserve.runner.model_step import collect_cache_layers
from pdserve.testing.kv_calibration import calibrate_kv_scales

_ATTN = re.compile(r"model\.layers\.\d+\.self_attn\.")


def _loud(name: str, t: torch.Tensor, f: float, raw: dict) -> torch.Tensor:
    leaf = _ATTN.sub("", name)
    if leaf in ("k_proj.weight", "v_proj.weight", "kv_a_layernorm.weight"):
        return t * f
    if leaf in ("q_proj.weight", "o_proj.weight") and "kv_lora_rank" not in raw:
        return t / f
    if leaf == "kv_b_proj.weight":
        return t / f
    lat, rope = raw.get("kv_lora_rank", 0), raw.get("qk_rope_head_dim", 0)
    if leaf == "kv_a_proj_with_mqa.weight":
        return torch.cat([t[:lat], t[lat:] * f])
    if leaf in ("q_b_proj.weight", "q_proj.weight"):
        heads = t.view(raw["num_attention_heads"], -1, t.shape[-1]).clone()
        heads[:, -rope:] /= f
        return heads.view_as(t)
    return t


def loud_kv_checkpoint(src: Path, dst: Path, factor: float) -> dict[str, torch.Tensor]:
    """Write the loud copy of ``src`` to ``dst``; returns the scales it stores."""
    shutil.copytree(src, dst)
    raw = load_hf_config(dst).raw
    path = dst / "model.safetensors"
    tensors = {n: _loud(n, t, factor, raw) for n, t in load_file(path).items()}
    save_file(tensors, path, {"format": "pt"})
    scales = calibrate_kv_scales(dst, num_prompts=2, prompt_len=16)
    save_file({**tensors, **scales}, path, {"format": "pt"})
    return scales


def drop_kv_scales(model: torch.nn.Module) -> None:
    """Back to scale 1.0, as a checkpoint without scales loads."""
    for m in model.modules():
        if isinstance(m, FP8CacheScales):
            m.k_scale = m.v_scale = None


def decode_logits(
    model: torch.nn.Module, ids: Sequence[int], fp8: bool, steps: Sequence[int], backend: str
) -> torch.Tensor:
    """Logits of every token of the last of ``steps`` (token counts that add up to
    ``len(ids)``, run one after another over one request's cache: a prompt, then chunks
    and decodes reading what the earlier steps cached), over a float32 or an fp8 cache
    on the model's device."""
    kv = PagedKV(model, 1, 64, backend=backend)
    if fp8:
        cfg, _ = collect_cache_layers(model, kv.block_size, "float32", "float8_e4m3fn")
        kv.caches = KVCaches.allocate(cfg, kv.caches.num_blocks, kv.device)
    t, done = torch.tensor(ids, device=kv.device), 0
    with torch.no_grad():
        for n in steps:
            with kv.step([done], [n]):
                hidden = model(t[done : done + n], torch.arange(done, done + n, device=kv.device))
            done += n
        return model.compute_logits(hidden)
