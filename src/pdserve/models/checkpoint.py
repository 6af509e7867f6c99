"""Random checkpoints in exact Hugging Face format (``pdserve make-checkpoint``).

No model is ever downloaded: tests and benchmarks run on checkpoints this module
writes. A checkpoint directory holds ``config.json``, ``model.safetensors`` (or
shards of at most ``max_shard_size`` bytes plus ``model.safetensors.index.json``),
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
``generation_config.json``; ``transformers`` loads it as it loads a real one.

Determinism: for a given (arch, preset, seed, dtype, device) the bytes written
are the same on every run. Tensors are drawn from one generator in a fixed order
(normal(0, 0.02); norm weights 1 + normal(0, 0.05)), independent of sharding, so
a sharded and a single-file checkpoint hold identical values. The tokenizer is a
byte-level BPE trained offline on a small built-in corpus (the ``tokenizers``
trainer is deterministic), plus each family's special tokens and chat template.

Memory: tensors are generated and written shard by shard, so the host holds at
most one shard (≤ ``max_shard_size``) at a time; with ``device="cuda"`` they are
drawn on the GPU and only copied to the host for writing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI flags need none
    import torch

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
PRESETS = ("tiny", "llama-8b-shape")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
INIT_STD = 0.02
NORM_NOISE = 0.05

# Model dimensions per preset (vocab_size None: the tokenizer's size).
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

_LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unsupported role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

_CHATML_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unsupported role: ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3's pre-tokenizer split (before byte-level mapping).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A serving engine receives requests, schedules them in batches, and streams tokens back.
Prefill computes the keys and values of the whole prompt; decode adds one token at a time.
The scheduler decides how many tokens each request computes in the next step.
When the cache is full, the engine preempts a request and frees its blocks.
Every block holds the keys and values of sixteen tokens for every layer of the model.
Hello, world! How are you doing today? I am fine, thank you, and you?
What time is it in Paris? It is three o'clock in the afternoon, and it's raining.
She said that they'll arrive tomorrow morning, but we're not sure they've left yet.
Numbers like 1, 2, 3, 42, 100, 2024 and 3.14159 appear in many documents.
Large language models predict the next token given all the tokens that came before.
Attention lets every position look at every earlier position in the sequence.
Rotary position embeddings rotate the queries and keys by an angle that grows with position.
The feed-forward network applies a gated linear unit with a SiLU activation.
Speculative decoding drafts several tokens cheaply and verifies them in one pass.
Disaggregated serving runs prefill and decode on different machines and moves the cache.
Latency targets: the time to first token and the time per output token must stay low.
Throughput is the number of tokens the system produces every second under load.
Once upon a time there was a little girl who lived in a village near the forest.
Water boils at one hundred degrees Celsius at sea level and freezes at zero.
The library opens at nine in the morning and closes at six in the evening.
Please write a short poem about the sea, the wind, and the light of the moon.
def main(): print("hello") # a small program that says hello
{"role": "user", "content": "What is the capital of France?"} The answer is Paris.
Mountains, rivers, forests and deserts cover the surface of the continents.
Good morning! Good evening! Good night! See you soon, my friend.
"""


@dataclass(frozen=True)
class _Family:
    """What differs between the two families besides the network."""

    model_type: str
    special_tokens: tuple[tuple[str, bool], ...]  # (token, special flag) in id order
    bos: str | None
    eos: str
    pad: str | None
    generation_eos: tuple[str, ...]
    chat_template: str


_FAMILIES = {
    "LlamaForCausalLM": _Family(
        model_type="llama",
        special_tokens=tuple(
            (t, True)
            for t in (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>",
                "<|finetune_right_pad_id|>",
                "<|step_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eom_id|>",
                "<|eot_id|>",
                "<|python_tag|>",
            )
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        chat_template=_LLAMA3_CHAT_TEMPLATE,
    ),
    "Qwen3ForCausalLM": _Family(
        model_type="qwen3",
        special_tokens=(
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<think>", False),
            ("</think>", False),
        ),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        chat_template=_CHATML_CHAT_TEMPLATE,
    ),
}


# --------------------------------------------------------------------- tokenizer
def build_tokenizer(arch: str, vocab_size: int = 512) -> _Backend:
    """A byte-level BPE of at most ``vocab_size`` ids (special tokens last), deterministic."""
    family = _family(arch)
    n_special = len(family.special_tokens)
    tok = _Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    for token, special in family.special_tokens:
        added = AddedToken(token, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    if family.bos is not None:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos}:0 $A:0",
            pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
            special_tokens=[(family.bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _tokenizer_files(arch: str, tok: _Backend, max_len: int) -> dict[str, dict[str, Any]]:
    family = _family(arch)
    named = {"bos_token": family.bos, "eos_token": family.eos, "pad_token": family.pad}
    named = {k: v for k, v in named.items() if v is not None}
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": family.bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": family.chat_template,
    }
    generation: dict[str, Any] = {}
    if family.bos is not None:
        generation["bos_token_id"] = _token_id(tok, family.bos)
    generation["eos_token_id"] = [_token_id(tok, t) for t in family.generation_eos]
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": dict(named),
        "generation_config.json": generation,
    }


def _token_id(tok: _Backend, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"token {token!r} is not in the generated tokenizer")
    return int(token_id)


# ------------------------------------------------------------------------ config
def build_config(
    arch: str, preset: str, tok: _Backend, dtype: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict for ``arch`` at ``preset`` size."""
    family = _family(arch)
    if preset not in _PRESET_DIMS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    dims = dict(_PRESET_DIMS[preset])
    tiny = preset == "tiny"
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family.model_type,
        **dims,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": _token_id(tok, family.bos or family.pad or family.eos),
        "eos_token_id": [_token_id(tok, t) for t in family.generation_eos],
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if family.model_type == "llama":
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


def weight_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of a Llama/Qwen3 checkpoint, in generation order."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    qk_norm = config["model_type"] == "qwen3"
    bias = config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (h,)))
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((f"{p}self_attn.{proj}.weight", (out, h)))
            if bias:
                shapes.append((f"{p}self_attn.{proj}.bias", (out,)))
        shapes.append((p + "self_attn.o_proj.weight", (h, q)))
        if bias:
            shapes.append((p + "self_attn.o_proj.bias", (h,)))
        if qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
        shapes.append((p + "post_attention_layernorm.weight", (h,)))
        for proj, out, inp in (
            ("gate_proj", inter, h),
            ("up_proj", inter, h),
            ("down_proj", h, inter),
        ):
            shapes.append((f"{p}mlp.{proj}.weight", (out, inp)))
            if mlp_bias:
                shapes.append((f"{p}mlp.{proj}.bias", (out,)))
    shapes.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (v, h)))
    return shapes


# ----------------------------------------------------------------------- weights
def _plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], itemsize: int, max_shard_size: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split in generation order; a tensor larger than the limit gets its own shard."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _random_tensors(
    shard: list[tuple[str, tuple[int, ...]]],
    gen: torch.Generator,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    for name, shape in shard:
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            t.normal_(1.0, NORM_NOISE, generator=gen)
        else:
            t.normal_(0.0, INIT_STD, generator=gen)
        yield name, t.cpu()


def _write_weights(
    out: Path,
    shapes: list[tuple[str, tuple[int, ...]]],
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    max_shard_size: int,
) -> None:
    import torch
    from safetensors.torch import save_file

    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(shapes, itemsize, max_shard_size)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            dict(_random_tensors(shards[0], gen, dtype, device)), out / "model.safetensors", meta
        )
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(_random_tensors(shard, gen, dtype, device))
        save_file(tensors, out / file_name, meta)
        weight_map.update((name, file_name) for name in tensors)
        del tensors
    total = sum(_numel(shape) * itemsize for _, shape in shapes)
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
) -> Path:
    """Write a random HF checkpoint for ``arch`` at ``preset`` size into ``out_dir``.

    ``config_overrides`` replaces ``config.json`` fields (e.g. ``tie_word_embeddings``)
    before the weights are shaped from it. Returns the directory.
    """
    _family(arch)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(arch)
    config = build_config(arch, preset, tok, dtype, config_overrides)
    torch_dtype = getattr(torch, dtype)
    _write_weights(out, weight_shapes(config), seed, torch_dtype, dev, max_shard_size)
    _write_json(out / "config.json", config)
    tok.save(str(out / "tokenizer.json"))
    for file_name, content in _tokenizer_files(
        arch, tok, config["max_position_embeddings"]
    ).items():
        _write_json(out / file_name, content)
    return out


def _family(arch: str) -> _Family:
    if arch not in _FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return _FAMILIES[arch]


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
        )
    except ValueError as e:
        print(f"make-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.arch} ({args.preset}, {args.dtype}, seed {args.seed}) to {out}")
    return 0
