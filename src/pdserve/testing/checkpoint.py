"""Random checkpoints in exact Hugging Face format (``pdserve make-checkpoint``).

No model is ever downloaded: tests and benchmarks run on checkpoints this module
writes. A checkpoint directory holds ``config.json``, ``model.safetensors`` (or
shards of at most ``max_shard_size`` bytes plus ``model.safetensors.index.json``),
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
``generation_config.json``; ``transformers`` loads it as it loads a real one.

Shapes come from the model, not from a second description of it: the generated
``config.json`` is parsed as the loader parses it, the registry's class for its
architecture is built on the meta device (no memory) in the checkpoint dtype,
and :meth:`~pdserve.models.registry.CausalLM.checkpoint_tensors` names every
tensor with its shape and dtype. Each tensor is written in its own dtype, so one
the model keeps in float32 (an MoE router) stays float32 in a bfloat16 checkpoint.

Values: each tensor is drawn from normal(mean, std), with (mean, std) looked up
by name suffix in :data:`INIT_RULES` (norm weights 1 + normal(0, 0.05), the MoE
routing bias normal(0, 0.02); everything else normal(0, 0.02)).

Determinism: for a given (arch, preset, seed, dtype, device) the bytes written
are the same on every run. Tensors are drawn from one generator in the model's
order (``checkpoint_tensors``: the order of its named modules), independent of
sharding, so a sharded and a single-file checkpoint hold identical values. The
tokenizer comes from :mod:`pdserve.testing.tokenizer_maker` (deterministic).

Memory: tensors are generated and written shard by shard, so the host holds at
most one shard (≤ ``max_shard_size``) at a time; with ``device="cuda"`` they are
drawn on the GPU and only copied to the host for writing. torch is imported only
where tensors are made, so registering the CLI flags needs none.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from pdserve.models.random_init import (
    INIT_RULES,
    INIT_STD,
    init_rule,
    random_tensors,
)
from pdserve.testing.tokenizer_maker import (
    ARCHS,
    SMALL_VOCAB,
    build_tokenizer,
    family,
    token_id,
    tokenizer_files,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch

    # HF tensor name → (shape, dtype), in generation order
    TensorSpecs: TypeAlias = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

__all__ = [
    "ARCHS",
    "DTYPES",
    "INIT_RULES",
    "PRESETS",
    "add_cli_args",
    "build_config",
    "build_tokenizer",
    "checkpoint_tensors",
    "init_rule",
    "main",
    "make_checkpoint",
    "parse_size",
]

PRESETS = (
    "tiny",
    "llama-8b-shape",
    "glm5-s4-e16",
    "glm5-m12-e64",
    "glm5-d24-e32",
    "glm52-s4-e16",
    "glm52-m12-e64",
    "glm52-d24-e32",
)
DEEPSEEK_ARCHS = ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9

# Model dimensions per preset.
_PRESET_DIMS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
    "llama-8b-shape": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
}


# The GLM-5 / DeepSeek family. tiny: small enough for CPU tests, yet 16 index heads
# (no exact top-k ties) and index_topk 16 (prompts exceed it), an MTP layer, a first
# dense layer. The H200 presets keep GLM-5's per-layer shapes with fewer layers and
# experts (layers, dense layers, experts); "glm52" adds GLM-5.2's index sharing.
_DEEPSEEK_TINY: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    head_dim=16,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    num_nextn_predict_layers=1,
)
_DSA_TINY = dict(index_n_heads=16, index_head_dim=32, index_topk=16)
_GLM5_LAYER: dict[str, Any] = dict(
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_shared_experts=1,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    head_dim=64,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    max_position_embeddings=202752,
    num_nextn_predict_layers=1,
)
_GLM5_SIZES = {"s4-e16": (4, 1, 16), "m12-e64": (12, 3, 64), "d24-e32": (24, 3, 32)}
_GLM52 = dict(index_topk_freq=4, index_skip_topk_offset=3, index_share_for_mtp_iteration=True)


def _deepseek_config(arch: str, preset: str) -> dict[str, Any]:
    """The family's fields for ``preset`` (GLM-5 presets exist for GlmMoeDsaForCausalLM only)."""
    if preset == "tiny":
        cfg = dict(_DEEPSEEK_TINY, rms_norm_eps=1e-5)
        if arch == "GlmMoeDsaForCausalLM":
            return {
                **cfg,
                **_DSA_TINY,
                "n_group": 1,
                "topk_group": 1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "rope_interleave": True,
                "indexer_rope_interleave": True,
            }
        # DeepSeek: grouped routing and YaRN, as the published V3 / V3.2 configs have them
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        cfg.update(n_group=2, topk_group=1, rope_parameters=yarn, rope_interleave=True)
        return {**cfg, **_DSA_TINY} if arch == "DeepseekV32ForCausalLM" else cfg
    if arch != "GlmMoeDsaForCausalLM" or not preset.startswith(("glm5-", "glm52-")):
        raise ValueError(f"preset {preset!r} is not a {arch} preset (try tiny, or glm5-*)")
    layers, dense, experts = _GLM5_SIZES[preset.split("-", 1)[1]]
    cfg = {
        **_GLM5_LAYER,
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense,
        "n_routed_experts": experts,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "rope_interleave": True,
        "indexer_rope_interleave": True,
    }
    return {**cfg, **_GLM52} if preset.startswith("glm52-") else cfg


# ------------------------------------------------------------------------ config
def build_config(
    arch: str, preset: str, tok: Tokenizer, dtype: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict for ``arch`` at ``preset`` size."""
    fam = family(arch)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    deepseek = arch in DEEPSEEK_ARCHS
    if deepseek:
        dims = _deepseek_config(arch, preset)
    elif preset in _PRESET_DIMS:
        dims = dict(_PRESET_DIMS[preset])
    else:
        raise ValueError(f"preset {preset!r} is not a {arch} preset (tiny or llama-8b-shape)")
    tiny = preset == "tiny"
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": fam.model_type,
        **dims,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": token_id(tok, fam.bos or fam.pad or fam.eos),
        "eos_token_id": [token_id(tok, t) for t in fam.generation_eos],
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if deepseek:
        config.update(tie_word_embeddings=False, scoring_func="sigmoid", topk_method="noaux_tc")
    elif fam.model_type == "llama":
        config.update(
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # tiny: small enough that the test positions cross all three frequency bands
                "original_max_position_embeddings": 64 if tiny else 8192,
            },
            mlp_bias=False,
            pretraining_tp=1,
            tie_word_embeddings=False,
        )
    else:
        config.update(
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling=None,
            sliding_window=None,
            use_sliding_window=False,
            max_window_layers=dims["num_hidden_layers"],
            tie_word_embeddings=tiny,
        )
    config.update(overrides or {})
    if config["vocab_size"] < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the tokenizer "
            f"({tok.get_vocab_size(with_added_tokens=True)} tokens)"
        )
    return config


def checkpoint_tensors(
    config: Mapping[str, Any], dtype: str | torch.dtype = "bfloat16"
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF tensor name → (shape, dtype) of the checkpoint ``config`` describes, in generation order.

    The model of ``config["architectures"][0]`` is built on the meta device in
    ``dtype`` and asked (:meth:`CausalLM.checkpoint_tensors`); nothing is allocated.
    """
    import torch

    from pdserve.models.hf_config import HFModelConfig
    from pdserve.models.random_init import full_checkpoint_specs

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return full_checkpoint_specs(HFModelConfig.from_dict(config), torch_dtype)


# ----------------------------------------------------------------------- weights
def _plan_shards(specs: TensorSpecs, max_shard_size: int) -> list[list[str]]:
    """Greedy split in generation order; a tensor larger than the limit gets its own shard."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in specs.items():
        nbytes = _numel(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_weights(
    out: Path,
    specs: TensorSpecs,
    seed: int,
    device: torch.device,
    max_shard_size: int,
    transform: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]],
) -> None:
    """Draw and write the tensors shard by shard; ``transform`` turns each shard's drawn
    tensors into the ones written (FP8: each quantized weight and its scales)."""
    import torch
    from safetensors.torch import save_file

    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = _plan_shards(specs, max_shard_size)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            {n: t.cpu() for n, t in transform(random_tensors(shards[0], specs, gen, device))},
            out / "model.safetensors",
            meta,
        )
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: t.cpu() for n, t in transform(random_tensors(shard, specs, gen, device))}
        save_file(tensors, out / file_name, meta)
        weight_map.update((name, file_name) for name in tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


# ---------------------------------------------------------------------- entry
def make_checkpoint(
    arch: str,
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    config_overrides: Mapping[str, Any] | None = None,
    config_only: bool = False,
    quantization: str | None = None,
    kv_cache_scales: bool = False,
) -> Path:
    """Write a random HF checkpoint for ``arch`` at ``preset`` size into ``out_dir``.

    ``config_overrides`` replaces ``config.json`` fields (e.g. ``tie_word_embeddings``)
    before the model is shaped from it; ``architectures`` among them picks the
    model class (the tokenizer stays ``arch``'s). ``config_only`` writes everything but
    the weights (serve it with ``--load-format dummy``: the same values, drawn on the
    device). ``quantization="fp8"`` writes a block-scaled FP8 checkpoint
    (:mod:`pdserve.models.quantization`): the same random values, each quantized
    linear as float8_e4m3fn ``weight`` plus ``weight_scale_inv`` per 128x128 block.
    ``kv_cache_scales`` then calibrates per-layer FP8 KV cache scales over those weights
    and writes them beside them (:mod:`pdserve.testing.kv_calibration`).
    Returns the directory.
    """
    family(arch)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(
            f"unsupported quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    tok = build_tokenizer(arch)
    config = build_config(arch, preset, tok, dtype, config_overrides)
    if config["vocab_size"] > SMALL_VOCAB:  # a benchmark size: the model's full vocabulary
        tok = build_tokenizer(arch, config["vocab_size"])
        config = build_config(arch, preset, tok, dtype, config_overrides)
    transform = _no_transform
    if quantization == "fp8":
        transform, config = _fp8(config, dtype)
    specs = checkpoint_tensors(config, dtype)  # before anything is written: errors leave no files
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from pdserve.models.kv_scales import KV_SCALES_FILE

    (out / KV_SCALES_FILE).unlink(missing_ok=True)  # a previous checkpoint's scales
    if not config_only:
        _write_weights(out, specs, seed, dev, max_shard_size, transform)
    _write_json(out / "config.json", config)
    tok.save(str(out / "tokenizer.json"))
    for file_name, content in tokenizer_files(arch, tok, config["max_position_embeddings"]).items():
        _write_json(out / file_name, content)
    if kv_cache_scales:
        from pdserve.testing.kv_calibration import calibrate_kv_scales, write_kv_scales

        fmt = "dummy" if config_only else "auto"
        write_kv_scales(out, calibrate_kv_scales(out, dev, fmt, seed))
    return out


def _no_transform(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    return tensors


def _fp8(config: dict[str, Any], dtype: str) -> tuple[Any, dict[str, Any]]:
    """(the FP8 tensor writer, the config with its ``quantization_config``)."""
    import torch

    from pdserve.models.hf_config import HFModelConfig
    from pdserve.models.quantization import default_fp8_config, fp8_checkpoint_writer

    cfg = default_fp8_config(config)
    config = {**config, "quantization_config": cfg.to_json()}
    writer = fp8_checkpoint_writer(HFModelConfig.from_dict(config), getattr(torch, dtype), cfg)
    return writer, config


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def parse_size(text: str) -> int:
    """``"5GB"``, ``"200MB"``, ``"1.5GiB"`` or plain bytes → bytes (decimal units as HF uses)."""
    units = {
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "B": 1,
    }
    s = text.strip().upper()
    number, mult = s, 1
    for unit, unit_bytes in units.items():
        if s.endswith(unit):
            number, mult = s[: -len(unit)].strip(), unit_bytes
            break
    try:
        value = int(float(number) * mult)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; use bytes or e.g. 5GB, 200MB") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve make-checkpoint``."""
    parser.add_argument("--arch", required=True, choices=ARCHS, help="HF architecture name")
    parser.add_argument("--preset", required=True, choices=PRESETS, help="model size")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype")
    parser.add_argument(
        "--device", default="cpu", help="where tensors are drawn (cuda is much faster for 8B)"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)"
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="fp8: block-scaled FP8 weights (e4m3, one scale per 128x128 block, as "
        "DeepSeek-V3 / GLM-5-FP8 ship them), quantized from the same random values",
    )
    parser.add_argument(
        "--kv-cache-scales",
        action="store_true",
        help="also calibrate per-layer FP8 KV cache scales (max |K|, |V| over a few random "
        "prompts / 448) into kv_cache_scales.safetensors, for --kv-cache-dtype fp8",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config and tokenizer but no weights (serve with --load-format dummy)",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``make-checkpoint``; returns the exit status (2 on invalid input)."""
    try:
        out = make_checkpoint(
            args.arch,
            args.preset,
            args.out,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
            max_shard_size=parse_size(str(args.max_shard_size)),
            config_only=args.config_only,
            quantization=getattr(args, "quantization", None),
            kv_cache_scales=getattr(args, "kv_cache_scales", False),
        )
    except ValueError as e:
        print(f"make-checkpoint: error: {e}", file=sys.stderr)
        return 2
    quant = f", {args.quantization}" if getattr(args, "quantization", None) else ""
    print(f"wrote {args.arch} ({args.preset}, {args.dtype}{quant}, seed {args.seed}) to {out}")
    return 0
