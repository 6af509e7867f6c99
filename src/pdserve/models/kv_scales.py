"""FP8 KV cache scales in a checkpoint: ``<attention module>.k_scale`` / ``.v_scale``.

The names are the ones ModelOpt and compressed-tensors checkpoints use, e.g.
``model.layers.3.self_attn.k_scale``: one float32 scalar per attention module (an
``...self_attn.attn.k_scale``, the cache owner's own path, is accepted too). A model's
``load_weights`` hands every tensor to :func:`load_kv_scale` first; a scale lands on the
module's cache owner (:class:`~pdserve.layers.attention.kv_scale.FP8CacheScales`), as a
host float that stays fixed once the weights are loaded.

``pdserve make-checkpoint --kv-cache-scales`` writes its calibrated scales, under the same
names, into a file of their own beside the weights, :data:`KV_SCALES_FILE` (the weight
files stay exactly what transformers loads, and the scales, which come from a forward
over the weights already written, need no weight shard rewritten);
:func:`load_kv_scales_file` reads it after the weights, with either load format.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.layers.attention.kv_scale import FP8CacheScales

KV_SCALES_FILE = "kv_cache_scales.safetensors"
_SUFFIXES = {".k_scale": "k", ".v_scale": "v"}


def is_kv_scale(name: str) -> bool:
    return name.endswith(tuple(_SUFFIXES))


def _owner(model: nn.Module, path: str, name: str) -> FP8CacheScales:
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        mod = None
    if not isinstance(mod, FP8CacheScales) and mod is not None:
        owners = [c for c in mod.children() if isinstance(c, FP8CacheScales)]
        mod = owners[0] if len(owners) == 1 else None
    if not isinstance(mod, FP8CacheScales):
        raise ValueError(
            f"unexpected tensor {name!r}: {type(model).__name__} has no attention module "
            f"{path!r} with a KV cache to scale"
        )
    return mod


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Set the KV cache scale ``name`` names on its layer; False if ``name`` is no scale.
    A scale must be one positive finite number (per-head scales are refused)."""
    suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    owner = _owner(model, name.removesuffix(suffix), name)
    if tensor.numel() != 1:
        raise ValueError(
            f"tensor {name!r} has shape {list(tensor.shape)}: only one KV cache scale per "
            "layer (per tensor) is supported"
        )
    owner.set_kv_scale(_SUFFIXES[suffix], float(tensor.float().item()), name)  # type: ignore[arg-type]
    return True


def load_kv_scales_file(model: nn.Module, model_dir: str | Path) -> int:
    """Load :data:`KV_SCALES_FILE` from ``model_dir`` if it is there, through the model's
    ``load_weights`` (so layers it did not build, e.g. MTP, are skipped as their weights
    are); returns how many tensors the file held. Any other tensor in it is refused."""
    path = Path(model_dir) / KV_SCALES_FILE
    if not path.is_file():
        return 0
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"cannot read safetensors file {path}: {e}") from e
    with handle as f:
        tensors = [(n, f.get_tensor(n)) for n in f.keys()]  # noqa: SIM118 (not a dict)
    other = [n for n, _ in tensors if not is_kv_scale(n)]
    if other:
        raise ValueError(f"{path}: tensor {other[0]!r} is not a KV cache scale")
    try:
        model.load_weights(iter(tensors))  # type: ignore[operator]
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return len(tensors)
