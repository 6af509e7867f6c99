"""Build a model from an HF checkpoint directory (safetensors, single file or sharded).

Memory: the model is constructed under ``with torch.device(device)`` with
uninitialised parameters of the target dtype, so its weights exist once, on the
target device; tensors are then read one at a time from the (memory-mapped)
safetensors files, straight onto the target device, and copied in. At no point
are two full copies of the weights alive. A model that ends up FP8 is built with its
linears and routed experts on the meta device
(:func:`~pdserve.layers.linear.deferred_weights`); the FP8 layers replace them on the
target device and the linears that stay dense are allocated after (``materialize``), so
the peak while loading is the FP8 model plus the one tensor being converted, never the
model in its bf16 size.

Tensor parallelism (a ``groups`` model option with a TP group of size n): the model is
built with this rank's shapes and names the tensors it holds a part of
(:meth:`~pdserve.models.registry.CausalLM.checkpoint_shards`); the loader reads only
that slice of each from the file (safetensors' ``get_slice``), and ``--load-format dummy``
draws the full tensor a single process would draw and keeps the rank's slice, so every
TP layout holds the same weights. FP8 layers take whole 128x128 blocks: a rank reads its
slice of each FP8 weight and of its ``weight_scale_inv`` (a split that would cut blocks is
refused when the model is built, naming the layer); see
:mod:`pdserve.models.quantization` for weights dequantized at load.

Every problem with the checkpoint is a ``ValueError`` that names the file and,
where there is one, the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.layers.linear import Shard, deferred_weights, materialize
from pdserve.models.hf_config import HFModelConfig, load_hf_config
from pdserve.models.kv_scales import load_kv_scales_file
from pdserve.models.quantization import (
    Fp8Config,
    Fp8WeightStream,
    checkpoint_fp8_weights,
    fuse_fp8_activations,
    quantize_model_experts,
    quantize_model_linears,
    resolve_quantization,
)
from pdserve.models.random_init import full_checkpoint_specs, random_tensors
from pdserve.models.registry import CausalLM, get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str, config: HFModelConfig | None = None) -> torch.dtype:
    """``"auto"`` → the config's ``torch_dtype`` (float32 when absent); names and dtypes pass."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a torch.dtype or a name, got {dtype!r}")
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        if config is None or config.torch_dtype is None:
            return torch.float32
        name = config.torch_dtype.lower().removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"{config.path}: torch_dtype {config.torch_dtype!r} is not supported")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def checkpoint_files(model_dir: str | Path) -> tuple[Path, dict[Path, set[str] | None]]:
    """(the file that lists the weights, {safetensors file: tensor names it should hold}).

    For a single-file checkpoint the names are ``None`` (whatever the file holds).
    """
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            data: Any = json.loads(index.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{index} is not valid JSON: {e}") from e
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
        shards: dict[Path, set[str]] = {}
        for name, file_name in sorted(weight_map.items()):
            path = root / file_name
            if not path.is_file():
                raise ValueError(
                    f"{index}: tensor {name!r} is mapped to {path}, which does not exist"
                )
            shards.setdefault(path, set()).add(name)
        return index, dict(shards.items())
    single = root / SINGLE_FILE
    if single.is_file():
        return single, {single: None}
    raise ValueError(f"no weights in {root}: neither {SINGLE_FILE} nor {INDEX_FILE} exists")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    **model_options: Any,
) -> tuple[CausalLM, HFModelConfig]:
    """Construct the model named by ``config.json`` and load its safetensors weights
    (``load_format="dummy"``: draw random ones on the device instead, from ``seed``, the
    values ``make-checkpoint`` would write with that seed on that device).
    A checkpoint with an FP8 ``quantization_config`` loads with FP8 linears; with
    ``quantization="fp8"`` an unquantized one is quantized as it loads
    (:mod:`pdserve.models.quantization`). ``model_options`` go to the model's
    constructor (e.g. ``with_mtp=True``, ``groups=`` a rank's
    :class:`~pdserve.distributed.groups.ParallelGroups`). A rank skips the checkpoint
    tensors of other ranks (``CausalLM.is_foreign_tensor``): from files it reads only its
    own; with ``dummy`` it draws every tensor in order and keeps its own, so it holds the
    values a single process would. Either way FP8 KV cache scales in a
    ``kv_cache_scales.safetensors`` beside the weights load last
    (:mod:`pdserve.models.kv_scales`)."""
    config = load_hf_config(model_dir)
    fp8 = resolve_quantization(config, quantization)
    model_cls = _model_class(config, fp8, model_options)
    torch_dtype = resolve_dtype(dtype, config)
    target = torch.device(device)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    if load_format == "dummy":
        model, stream = _build(model_cls, config, torch_dtype, target, fp8, model_options)
        specs = full_checkpoint_specs(config, torch_dtype)  # the order make-checkpoint draws in
        gen = torch.Generator(device=target).manual_seed(seed)
        drawn = random_tensors(list(specs), specs, gen, target)
        mine = ((n, t) for n, t in drawn if not model.is_foreign_tensor(n))
        model.load_weights(stream(_take_shards(mine, stream)))
        load_kv_scales_file(model, model_dir)
        return model.eval(), config
    source, files = checkpoint_files(model_dir)  # validate before allocating anything
    model, stream = _build(model_cls, config, torch_dtype, target, fp8, model_options)
    loaded: set[str] = set()
    for path, names in sorted(files.items()):
        loaded |= _load_file(model, path, names, target, stream)
    stream.finish(source)
    missing = model.checkpoint_tensor_names() - loaded
    if missing:
        shown = ", ".join(repr(n) for n in sorted(missing)[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{source}: missing tensor(s) {shown}{more}")
    load_kv_scales_file(model, model_dir)
    return model.eval(), config


def check_model_options(
    model_dir: str | Path, quantization: str | None = None, **model_options: Any
) -> None:
    """Raise the ValueError :func:`load_model` would raise for these options (e.g. a
    tensor-parallel size that does not divide the heads) without loading anything: the
    model is built on the meta device. Run before starting rank processes."""
    config = load_hf_config(model_dir)
    fp8 = resolve_quantization(config, quantization)
    model_cls = _model_class(config, fp8, model_options)
    meta = torch.device("meta")
    _build(model_cls, config, torch.float32, meta, fp8, model_options)  # FP8 splits too


def _model_class(
    config: HFModelConfig, fp8: Fp8Config | None, model_options: dict[str, Any]
) -> type[CausalLM]:
    """The model class, once the options are known to fit the checkpoint."""
    model_cls = get_model_class(config)
    if model_options.get("with_mtp") and not getattr(model_cls, "has_mtp", False):
        raise ValueError(
            f"--speculative-config: method mtp needs a model with MTP layers "
            f"({config.architecture} has none)"
        )
    return model_cls


def _build(
    model_cls: type[CausalLM],
    config: HFModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    fp8: Fp8Config | None,
    model_options: dict[str, Any],
) -> tuple[CausalLM, Fp8WeightStream]:
    """The model on ``device`` with uninitialised weights, FP8 layers in place (see the
    module doc: no linear is ever allocated in the model dtype first), and the stream
    that adapts checkpoint tensors to it (a plain model's stream still dequantizes an FP8
    tensor it meets, scales permitting)."""
    with torch.device(device), deferred_weights():
        model = model_cls(config, dtype, **model_options)
    names: frozenset[str] = frozenset()
    if fp8 is not None:
        names = frozenset(checkpoint_fp8_weights(model, fp8))
        quantize_model_linears(model, fp8, device)
        quantize_model_experts(model, fp8, device)
        fuse_fp8_activations(model)
    materialize(model, device)  # the layers that stay in the model dtype
    model.configure_decode()
    return model, Fp8WeightStream(model.checkpoint_tensors(), names, model.checkpoint_shards())


def _take_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], stream: Fp8WeightStream
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors -> this rank's slice of those it holds a part of (except those the
    stream takes whole)."""
    for name, t in tensors:
        shard = stream.shards.get(name)
        if shard is None or stream.reads_whole(name):
            yield name, t
        else:
            yield name, shard.of(t)


def _load_file(
    model: CausalLM,
    path: Path,
    expected: set[str] | None,
    device: torch.device,
    stream: Fp8WeightStream,
) -> set[str]:
    """Load every tensor of one safetensors file (only this rank's slice of those in
    ``stream.shards``, unless the stream takes it whole); errors name the file."""
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"cannot read safetensors file {path}: {e}") from e
    with handle as f:
        stored = f.keys()
        names = [n for n in stored if not model.is_foreign_tensor(n)]
        if expected is not None:
            absent = {n for n in expected if not model.is_foreign_tensor(n)} - set(names)
            if absent:
                raise ValueError(
                    f"{path}: the index maps tensor {sorted(absent)[0]!r} here but the file "
                    "does not hold it"
                )

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name in names:
                shard = stream.shards.get(name)
                if shard is None or stream.reads_whole(name, _stored_fp8(f, name)):
                    yield name, f.get_tensor(name)
                else:
                    yield name, _read_slice(f, name, shard)

        try:
            return model.load_weights(stream(tensors()))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def _stored_fp8(f: Any, name: str) -> bool:
    return bool(f.get_slice(name).get_dtype() == "F8_E4M3")


def _read_slice(f: Any, name: str, shard: Shard) -> torch.Tensor:
    """Read ``shard`` of tensor ``name`` from an open safetensors file (only those bytes)."""
    part = f.get_slice(name)
    shape = part.get_shape()
    if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
        raise ValueError(
            f"tensor {name!r} has shape {list(shape)} but the model expects {shard.full} "
            f"along dimension {shard.dim} (split over the tensor-parallel ranks)"
        )
    return part[shard.index()]
