"""Engine configuration: frozen dataclasses, validated once, with CLI flags generated from them.

Each field's ``metadata`` carries its help text; the flag name is the field name with
dashes (``max_num_seqs`` -> ``--max-num-seqs``), matching ``vllm serve`` wherever the
meaning is the same. Values are validated in ``__post_init__`` with messages that
name the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

from pdserve.config.json_arg import parse_json_arg
from pdserve.config.kv_transfer import KVTransferConfig
from pdserve.config.speculative import SpeculativeConfig


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f("", "path to a Hugging Face model folder", positional=True)
    dtype: str = _f("auto", "weights/activations dtype: auto|float32|bfloat16|float16|half|float")
    max_model_len: int | None = _f(
        None, "context length (prompt + output); default from config.json"
    )
    seed: int = _f(0, "random seed for sampling without an explicit per-request seed")
    tokenizer: str | None = _f(None, "tokenizer folder (default: the model folder)")
    load_format: str = _f(
        "auto",
        "auto: the safetensors in the model folder; dummy: random weights drawn on the "
        "device from config.json alone, the values make-checkpoint writes (benchmarks)",
    )
    quantization: str | None = _f(
        None,
        "fp8: quantize an unquantized checkpoint's linears to block-scaled FP8 as it loads "
        "(a checkpoint with an fp8 quantization_config loads as FP8 without this flag)",
    )

    def __post_init__(self) -> None:
        _check(
            self.dtype in ("auto", "float32", "float", "bfloat16", "float16", "half"),
            f"--dtype must be one of auto, float32, bfloat16, float16 (got {self.dtype!r})",
        )
        _check(self.max_model_len is None or self.max_model_len > 1, "--max-model-len must be > 1")
        _check(
            self.load_format in ("auto", "dummy"),
            f"--load-format must be auto or dummy (got {self.load_format!r})",
        )
        _check(
            self.quantization in (None, "fp8"),
            f"--quantization must be fp8 (got {self.quantization!r})",
        )


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _f(16, "tokens per KV cache block")
    gpu_memory_utilization: float = _f(0.9, "share of GPU memory the engine may use (GPU only)")
    kv_cache_memory_bytes: int | None = _f(
        None,
        "KV cache size in bytes (default on CPU: 256 MiB; on GPU: from --gpu-memory-utilization)",
    )
    num_gpu_blocks_override: int | None = _f(None, "use exactly this many KV blocks (testing)")
    enable_prefix_caching: bool = _f(True, "reuse KV of shared prompt prefixes")
    kv_cache_dtype: str = _f(
        "auto",
        "auto: the model dtype; fp8 (= fp8_e4m3): float8_e4m3fn GQA K/V and MLA latent "
        "caches with static per-layer scales from the checkpoint's k_scale/v_scale (else "
        "1.0; values saturate at +-448 x scale), and DSA indexer keys in float8_e4m3fn "
        "with a float32 scale per key computed as it is written (amax / 448)",
    )

    def __post_init__(self) -> None:
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "--block-size must be a power of 2 <= 128",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0, "--gpu-memory-utilization must be in (0, 1]"
        )
        _check(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            "--num-gpu-blocks-override must be >= 2",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
            f"(got {self.kv_cache_dtype!r})",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(256, "most requests in one step")
    max_num_batched_tokens: int = _f(8192, "most tokens computed in one step (token budget)")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps to fit the budget")
    async_scheduling: bool = _f(
        True,
        "schedule and prepare step N+1 while step N runs on the device (one step in "
        "flight); a request that stops on a sampled token computes one discarded token",
    )
    scheduling_policy: str = _f(
        "fcfs",
        "fcfs: first come, first served | priority: waiting requests by their priority "
        "(lower first, then arrival), preemption takes the lowest-priority running request",
    )
    disable_log_stats: bool = _f(
        False,
        "no periodic stats line (throughput, queue, KV usage, prefix hits, speculative "
        "acceptance) in the engine's log every 10 s",
    )

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "--max-num-seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be >= 1")
        _check(
            self.scheduling_policy in ("fcfs", "priority"),
            f"--scheduling-policy must be fcfs or priority (got {self.scheduling_policy!r})",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks of one instance: ``data_parallel_size`` engine cores (each with its own
    scheduler and KV pool), each driving ``tensor_parallel_size`` model shards; one
    process and one device per rank."""

    tensor_parallel_size: int = _f(
        1, "tensor-parallel ranks: attention heads, MLP and vocabulary split over this many"
    )
    data_parallel_size: int = _f(
        1, "data-parallel ranks: engine cores behind this API server, each with its own batch"
    )
    enable_expert_parallel: bool = _f(
        False,
        "spread the MoE experts over the data-parallel ranks (tokens dispatched and "
        "combined with all-to-all); every rank runs each step, idle ones a dummy batch",
    )

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "--tensor-parallel-size must be >= 1")
        _check(self.data_parallel_size >= 1, "--data-parallel-size must be >= 1")
        _check(
            self.tensor_parallel_size == 1 or self.data_parallel_size == 1,
            "--tensor-parallel-size > 1 together with --data-parallel-size > 1 is not "
            "supported yet (choose one)",
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str = _f("auto", "cpu | cuda | cuda:N | auto (cuda when available)")
    attention_backend: str = _f(
        "auto", "attention backend: auto (triton on GPU, torch on CPU) | triton | torch (reference)"
    )

    def __post_init__(self) -> None:
        _check(
            self.attention_backend in ("auto", "triton", "torch"),
            f"--attention-backend must be auto, triton or torch (got {self.attention_backend!r})",
        )


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
DEFAULT_CAPTURE_SIZES = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
)


@dataclass(frozen=True)
class CompilationConfig:
    """CUDA graphs, named as in vLLM's ``--compilation-config``.

    ``FULL_DECODE_ONLY``: the whole forward (model + logits) of a uniform decode batch
    (every request computing the same 1+k tokens) is replayed from a graph keyed by
    (padded batch size, tokens per request); any other batch runs eagerly.
    ``cudagraph_mode`` None means: FULL_DECODE_ONLY on CUDA with a graph-capable
    attention backend, NONE otherwise.
    """

    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # default: DEFAULT_CAPTURE_SIZES

    def __post_init__(self) -> None:
        _check(
            self.cudagraph_mode is None or self.cudagraph_mode in CUDAGRAPH_MODES,
            f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)} (got {self.cudagraph_mode!r})",
        )
        sizes = self.cudagraph_capture_sizes
        _check(
            sizes is None or (len(sizes) > 0 and all(isinstance(x, int) and x >= 1 for x in sizes)),
            "cudagraph_capture_sizes must be a non-empty list of positive integers",
        )

    @classmethod
    def from_json(cls, value: str | dict | None, enforce_eager: bool = False) -> CompilationConfig:
        obj = parse_json_arg(value or {}, "--compilation-config")
        known = {"cudagraph_mode", "cudagraph_capture_sizes"}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(
                f"--compilation-config key(s) {', '.join(sorted(unknown))} are not supported "
                f"(supported: {', '.join(sorted(known))})"
            )
        mode = obj.get("cudagraph_mode")
        if isinstance(mode, int):  # vLLM also accepts the enum's integer value
            mode = {0: "NONE"}.get(mode, mode)
        if enforce_eager:
            if mode not in (None, "NONE"):
                raise ValueError("--enforce-eager contradicts cudagraph_mode " + str(mode))
            mode = "NONE"
        sizes = obj.get("cudagraph_capture_sizes")
        return cls(mode, tuple(sizes) if sizes is not None else None)

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        sizes = self.cudagraph_capture_sizes or DEFAULT_CAPTURE_SIZES
        out = sorted({s for s in sizes if s <= max_num_seqs})
        if not out or out[-1] < max_num_seqs and self.cudagraph_capture_sizes is None:
            out.append(max_num_seqs)
        return sorted(set(out))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    kv_transfer: KVTransferConfig | None = None  # ``--kv-transfer-config``
    speculative: SpeculativeConfig | None = None  # ``--speculative-config``

    SECTIONS = ("model", "cache", "scheduler", "parallel", "device")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model, dtype=..., max_num_seqs=...)``).

        ``compilation_config`` (a dict or JSON string) and ``enforce_eager`` are taken as
        in vLLM."""
        parts: dict[str, Any] = {}
        left = dict(kwargs)
        kvt = left.pop("kv_transfer_config", None)
        parts["kv_transfer"] = (
            kvt if isinstance(kvt, KVTransferConfig) else KVTransferConfig.from_json(kvt)
        )
        parts["speculative"] = SpeculativeConfig.from_json(left.pop("speculative_config", None))
        comp = left.pop("compilation_config", None)
        parts["compilation"] = (
            comp
            if isinstance(comp, CompilationConfig)
            else CompilationConfig.from_json(comp, bool(left.pop("enforce_eager", False)))
        )
        for name in cls.SECTIONS:
            sec_cls = _section_class(name)
            names = {f.name for f in dataclasses.fields(sec_cls)}
            parts[name] = sec_cls(**{k: left.pop(k) for k in list(left) if k in names})
        if left:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(left))}")
        return cls(**parts)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        names = [
            *engine_option_names(),
            "compilation_config",
            "enforce_eager",
            "kv_transfer_config",
            "speculative_config",
        ]
        return cls.from_kwargs(**{k: getattr(args, k) for k in names if hasattr(args, k)})


def _section_class(name: str) -> type:
    return {
        "model": ModelConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "parallel": ParallelConfig,
        "device": DeviceConfig,
    }[name]


def engine_option_names() -> list[str]:
    return [f.name for s in EngineConfig.SECTIONS for f in dataclasses.fields(_section_class(s))]


def _base_type(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()
) -> None:
    """Add one flag per field of ``cls`` (bools get ``--x/--no-x``)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        tp, _ = _base_type(hints[f.name])
        if f.metadata.get("positional"):
            parser.add_argument(f.name, help=f.metadata["help"])
            continue
        flag = "--" + f.name.replace("_", "-")
        if tp is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f.metadata["help"],
            )
        else:
            parser.add_argument(flag, type=tp, default=f.default, help=f.metadata["help"])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for s in EngineConfig.SECTIONS:
        add_dataclass_args(parser, _section_class(s))
    parser.add_argument(
        "--compilation-config",
        "-O",
        default=None,
        help='JSON, e.g. \'{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 8, 64]}\'',
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="never use CUDA graphs (cudagraph_mode NONE)"
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\' or '
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help='P/D role, e.g. \'{"kv_connector": "PdConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"transport": "tcp"}}\'',
    )
