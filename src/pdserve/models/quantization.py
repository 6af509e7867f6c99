"""Block-scaled FP8 checkpoints: the ``quantization_config`` they carry, which modules
are FP8, and the weight stream between the safetensors files and the model.

Format (DeepSeek-V3, GLM-5-FP8): ``quantization_config`` ``{"quant_method": "fp8", "fmt":
"e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
"modules_to_not_convert": [...]}``; each quantized linear ``X`` stores ``X.weight``
(float8_e4m3fn) and ``X.weight_scale_inv`` (float32, one per 128x128 block, partial
edge blocks included). Every :class:`~pdserve.layers.linear.Linear` and every routed
expert projection is quantized except the modules ``modules_to_not_convert`` names
(matched as whole dotted components of the module path). Embeddings, the LM head, norms
and the MoE router are never linears here, so they stay in the model dtype. Any other
``quant_method``, format, block size or a static activation scheme is refused.

Activations: where every consumer of a norm's or SiLU-and-mul's output is a block-FP8
linear, the producer emits the FP8 activation itself (:func:`fuse_fp8_activations`,
after the swap below), so no GEMM quantizes ``x`` again.

In memory (``load_model``): quantized linears become
:class:`~pdserve.layers.fp8.Fp8Linear` (tensor-parallel ones their FP8 counterparts in
:mod:`pdserve.layers.fp8_parallel`, each rank holding whole 128x128 blocks), except the modules a family reads as raw weights
(``CausalLM.fp8_dense_modules``: MLA's ``kv_b_proj``, absorbed into attention), which are
dequantized to the model dtype at load. The routed experts stay FP8 too
(:func:`quantize_model_experts`): :class:`~pdserve.layers.moe.RoutedExperts` holds FP8
stacks with their per-expert 128x128 block scales (the experts' bytes halve against
bf16) and runs the block-FP8 fused MoE kernel, or its dequantize-then-compute reference
where fused kernels are off.

:class:`Fp8WeightStream` sits between the files and ``CausalLM.load_weights``: it passes
FP8 tensors through to FP8 parameters (repeating scales over the rows of an unaligned
merged layer), dequantizes FP8 tensors meant for bf16 parameters, and quantizes bf16
tensors meant for FP8 parameters (``--quantization fp8`` on a bf16 checkpoint, and
``--load-format dummy``), with the same function ``make-checkpoint`` writes with.

Under tensor parallelism the loader hands the stream each rank's slice of a sharded
tensor (FP8 weights with their slice of block scales). A quantized layer's slice is
whole blocks, so quantizing it gives exactly that slice of the full weight's
quantization. A weight dequantized to a dense layer (``kv_b_proj``) may be split off the
block grid, so the loader reads it whole (:meth:`Fp8WeightStream.reads_whole`) and the
stream keeps the rank's slice after dequantizing it (or after the quantize + dequantize
round trip of a bf16 checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.kernels.reference import FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.attention.dsa import Indexer
from pdserve.layers.fp8 import Fp8Linear, expand_scale_rows
from pdserve.layers.fp8_parallel import convert_linears
from pdserve.layers.linear import MergedLinear, Shard, is_plain_linear
from pdserve.layers.moe import RoutedExperts, TopKRouter
from pdserve.layers.norm import RMSNorm
from pdserve.models.hf_config import HFModelConfig

QUANTIZATION_METHODS = ("fp8",)
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# what make-checkpoint and load-time quantization leave in the model dtype, per family
DEFAULT_NOT_CONVERT: dict[str, tuple[str, ...]] = {
    "llama": ("lm_head",),
    "qwen3": ("lm_head",),
    "deepseek": ("lm_head", "weights_proj"),  # the DSA indexer's per-head weights
}


@dataclass(frozen=True)
class Fp8Config:
    modules_to_not_convert: tuple[str, ...] = ()

    def skips(self, module_name: str) -> bool:
        """Whether ``module_name`` stays unquantized (a pattern matches whole components)."""
        padded = f".{module_name}."
        return any(f".{p.strip('.')}." in padded for p in self.modules_to_not_convert)

    def to_json(self) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(BLOCK),
            "activation_scheme": "dynamic",
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


def default_fp8_config(config: HFModelConfig | Mapping[str, Any]) -> Fp8Config:
    model_type = (
        config.model_type if isinstance(config, HFModelConfig) else config.get("model_type")
    )
    key = model_type if model_type in DEFAULT_NOT_CONVERT else "deepseek"
    return Fp8Config(DEFAULT_NOT_CONVERT[key])


def resolve_quantization(config: HFModelConfig, quantization: str | None) -> Fp8Config | None:
    """The checkpoint's FP8 config, or the default one when ``quantization`` is ``"fp8"``
    and the checkpoint is unquantized (quantize at load); None for a plain model.
    Unsupported methods and formats are a ValueError naming the file and the field."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization {quantization!r} is not supported (supported: "
            f"{', '.join(QUANTIZATION_METHODS)})"
        )
    raw = config.raw.get("quantization_config")
    if raw is None:
        return default_fp8_config(config) if quantization == "fp8" else None
    where = f"{config.path}: quantization_config"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{where}.quant_method {method!r} is not supported; pdserve loads block-scaled "
            "FP8 checkpoints (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128])"
        )
    checks = (
        ("fmt", raw.get("fmt", "e4m3"), "e4m3"),
        ("weight_block_size", raw.get("weight_block_size"), list(BLOCK)),
        ("activation_scheme", raw.get("activation_scheme", "dynamic"), "dynamic"),
    )
    for field, value, want in checks:
        if value != want:
            raise ValueError(
                f"{where}.{field} {value!r} is not supported (only {want!r}: per-128x128-block "
                "weight scales and activations quantized per token at run time)"
            )
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{where}.modules_to_not_convert must be a list of module names")
    return Fp8Config(tuple(skip))


def _parts(name: str, module: nn.Module) -> list[str]:
    """HF module names a linear stands for (a merged layer: its parts)."""
    if isinstance(module, MergedLinear):
        parent = name.rpartition(".")[0]
        return [f"{parent}.{p}" if parent else p for p in module.parts]
    return [name]


def checkpoint_fp8_weights(model: nn.Module, cfg: Fp8Config) -> set[str]:
    """HF names of the weights an FP8 checkpoint of ``model`` stores quantized (each with a
    ``weight_scale_inv`` beside it). Works on a model built on the meta device."""
    out: set[str] = set()
    for name, module in model.named_modules():
        if is_plain_linear(module):
            out.update(f"{p}.weight" for p in _parts(name, module) if not cfg.skips(p))
        elif isinstance(module, RoutedExperts) and not cfg.skips(name):
            for e in module.local_expert_ids:
                views = module.expert_views(e)
                out.update(f"{name}.{e}.{part}" for part in views if part.endswith(".weight"))
    return out


def quantize_model_linears(
    model: nn.Module, cfg: Fp8Config, device: torch.device | None = None
) -> list[str]:
    """Swap the linears that stay FP8 in memory for empty FP8 layers on ``device`` (default:
    where each one is) (see module doc); returns their names."""
    dense = tuple(getattr(model, "fp8_dense_modules", ()))

    def keep_fp8(name: str, module: nn.Module) -> bool:
        leaf = name.rpartition(".")[2]
        return leaf not in dense and not any(cfg.skips(p) for p in _parts(name, module))

    return convert_linears(model, keep_fp8, device)


def quantize_model_experts(
    model: nn.Module, cfg: Fp8Config, device: torch.device | None = None
) -> list[str]:
    """Make every :class:`RoutedExperts` not in ``modules_to_not_convert`` hold empty FP8
    stacks on ``device`` (:meth:`RoutedExperts.use_fp8`; before loading: values are not
    kept); returns their names."""
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, RoutedExperts) and not cfg.skips(name)
    ]
    for name in names:
        routed = model.get_submodule(name)
        assert isinstance(routed, RoutedExperts)
        routed.use_fp8(device, name)
    return names


def fuse_fp8_activations(model: nn.Module) -> list[str]:
    """Set ``quant_out`` on each producer of the model's ``fp8_activation_links()`` whose
    consumers are all block-FP8 linears (after :func:`quantize_model_linears`): the
    producer (an RMSNorm or SiLU-and-mul) then hands them an
    :class:`~pdserve.kernels.reference.Fp8Activation`, quantized in its own kernel, and
    the GEMMs read it instead of quantizing ``x`` in every N tile; FP8 routed experts read
    it the same way. Consumers that need the bf16 output and are handed the activation's
    ``hp`` by their caller (the MoE router, the DSA indexer: :func:`_consumer_kind`) make
    the norm keep that output beside the fp8 one (``quant_keep_hp``, one kernel). A
    producer with any other consumer (a bf16 linear) stays bf16. The values are
    unchanged: the GEMMs quantize a bf16 input the same way. Returns the producers
    switched."""
    links = getattr(model, "fp8_activation_links", None)
    if links is None:
        return []
    switched = []
    for producer_name, consumers in links():
        producer = model.get_submodule(producer_name)
        if not isinstance(producer, (RMSNorm, SiluAndMul)):
            raise TypeError(f"{producer_name} ({type(producer).__name__}) has no fp8 output mode")
        kinds = {_consumer_kind(model.get_submodule(c)) for c in consumers}
        fp8 = "fp8" in kinds and kinds <= {"fp8", "hp"}
        keep_hp = fp8 and "hp" in kinds
        if keep_hp and not isinstance(producer, RMSNorm):
            raise TypeError(f"{producer_name}: only an RMSNorm keeps its output beside fp8")
        producer.quant_out = fp8
        if isinstance(producer, RMSNorm):
            producer.quant_keep_hp = keep_hp
        if fp8:
            switched.append(producer_name)
    return switched


def _consumer_kind(module: nn.Module) -> str:
    """``fp8``: reads an Fp8Activation (a block-FP8 linear, FP8 routed experts without
    expert parallelism); ``hp``: its module's caller hands it the activation's ``hp``
    (the MoE router and expert-parallel experts, in ``MoE.forward``; the DSA indexer, in
    the GLM-5 attention); ``bf16``: anything else, which keeps the producer in bf16."""
    if isinstance(module, Fp8Linear):
        return "fp8"
    if isinstance(module, RoutedExperts):
        return "fp8" if module.fp8 and module.ep.size == 1 else "hp"
    if isinstance(module, (TopKRouter, Indexer)):
        return "hp"
    return "bf16"


class Fp8WeightStream:
    """Adapts checkpoint tensors to the model's parameters (see the module docstring).

    ``targets``: the model's ``checkpoint_tensors()`` (name -> (shape, dtype)), taken after
    :func:`quantize_model_linears` and :func:`quantize_model_experts`. ``fp8_names``: the
    weights an FP8 checkpoint stores quantized; an unquantized one among them meant for a
    bf16 parameter (``kv_b_proj``) goes through quantize + dequantize, so quantizing at
    load gives the values loading the FP8 checkpoint gives. ``shards``: the model's
    ``checkpoint_shards()`` (this rank's slices under TP). Call :meth:`finish` after the
    last file."""

    def __init__(
        self,
        targets: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        fp8_names: frozenset[str] = frozenset(),
        shards: Mapping[str, Shard] | None = None,
    ) -> None:
        self.targets = targets
        self.fp8_names = fp8_names
        self.shards = dict(shards or {})
        self.weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scales
        self.scales: dict[str, torch.Tensor] = {}  # scales waiting for their FP8 weights

    def _fp8_target(self, name: str) -> bool:
        return name in self.targets and self.targets[name][1] == FP8_DTYPE

    def reads_whole(self, name: str, stored_fp8: bool = False) -> bool:
        """Whether the loader should hand over the whole of tensor ``name``, although this
        rank holds only a slice of it: a weight that is (or, ``stored_fp8``, is stored)
        FP8 in the checkpoint and dense here, whose blocks may straddle the ranks."""
        return (
            name in self.shards
            and not self._fp8_target(name)
            and (stored_fp8 or name in self.fp8_names)
        )

    def _own(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t`` when it is the whole of a sharded tensor."""
        shard = self.shards.get(name)
        if shard is None or shard.stop - shard.start == shard.full:
            return t
        return shard.of(t) if t.shape[shard.dim] == shard.full else t

    def _scale_for(self, weight_name: str, scale: torch.Tensor) -> torch.Tensor:
        rows = self.targets[weight_name][0][0]
        target_rows = self.targets[weight_name + SCALE_SUFFIX][0][0]
        return expand_scale_rows(scale.float(), rows, target_rows)

    def _dequantized(self, name: str) -> tuple[str, torch.Tensor]:
        q, s = self.weights.pop(name), self.scales.pop(name)
        dtype = self.targets[name][1] if name in self.targets else torch.float32
        return name, self._own(name, dequantize_fp8_blocks(q, s, BLOCK, dtype))

    def __call__(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors:
            if name.endswith(".weight" + SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                if self._fp8_target(weight):
                    yield name, self._scale_for(weight, t)
                    continue
                self.scales[weight] = t
                if weight in self.weights:
                    yield self._dequantized(weight)
            elif t.dtype == FP8_DTYPE and not self._fp8_target(name):
                self.weights[name] = t
                if name in self.scales:
                    yield self._dequantized(name)
            elif t.dtype != FP8_DTYPE and self._fp8_target(name):
                q, s = quantize_fp8_blocks(t, BLOCK)
                yield name, q
                yield name + SCALE_SUFFIX, self._scale_for(name, s)
            elif name in self.fp8_names and t.dtype != FP8_DTYPE:
                q, s = quantize_fp8_blocks(t, BLOCK)
                yield name, self._own(name, dequantize_fp8_blocks(q, s, BLOCK, t.dtype))
            else:
                yield name, t

    def finish(self, source: object) -> None:
        """Refuse FP8 weights whose scales never came (and scales without weights)."""
        for what, left in (("weight_scale_inv", self.weights), ("FP8 weight", self.scales)):
            if left:
                name = sorted(left)[0]
                raise ValueError(f"{source}: FP8 tensor {name!r} has no {what} in the checkpoint")


def fp8_checkpoint_writer(config: HFModelConfig, dtype: torch.dtype, cfg: Fp8Config) -> Any:
    """A function turning a stream of unquantized checkpoint tensors into the FP8
    checkpoint's (each quantized weight followed by its ``weight_scale_inv``): what
    ``make-checkpoint --quantization fp8`` writes. The model is shaped on the meta device."""
    from pdserve.models.registry import get_model_class

    options = {"with_mtp": True} if config.raw.get("num_nextn_predict_layers") else {}
    with torch.device("meta"):
        model = get_model_class(config)(config, dtype, **options)
    names = checkpoint_fp8_weights(model, cfg)

    def write(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors:
            if name in names:
                q, s = quantize_fp8_blocks(t, BLOCK)
                yield name, q
                yield name + SCALE_SUFFIX, s
            else:
                yield name, t

    return write
