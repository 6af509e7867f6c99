"""Deterministic tokenizers of the random checkpoints (see :mod:`pdserve.testing.checkpoint`).

Each supported architecture has a *family*: its special tokens (in id order,
after the trained vocabulary), BOS/EOS/PAD, the EOS ids of its generation config
and its chat template (Llama 3 headers or ChatML). The tokenizer is a byte-level
BPE trained offline on a small built-in corpus with Llama 3's pre-tokenizer
split; the ``tokenizers`` trainer is deterministic, so the same architecture and
vocabulary size always give the same ``tokenizer.json``. No torch needed.

Vocabulary size: the tiny test checkpoints keep a few hundred tokens (fast to build,
and the tests' expectations rest on them). Benchmark-sized checkpoints
(``vocab_size`` above :data:`SMALL_VOCAB`) get a tokenizer whose vocabulary is the
model's, every id a real BPE token: vLLM-style random prompts draw ids from the
tokenizer's vocabulary, and from a few hundred ids they repeat (on the H200, 41% of the
prompt tokens of a 500 x 1024 run were prefix-cache hits). No registry package ships a
BPE of 128K-155K tokens that may be used offline, so one is built here with
``tokenizers``: the built-in corpus plus a deterministic synthetic one of pseudo-words
(letters drawn by a seeded generator, each word twice so every one can become a
token), sized so the trainer reaches the target. Building one takes about 20 s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

__all__ = [
    "ARCHS",
    "FAMILIES",
    "SMALL_VOCAB",
    "Family",
    "build_tokenizer",
    "family",
    "token_id",
    "tokenizer_files",
]

ARCHS = (
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM",
)

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

# GLM-4.5+/GLM-5's chat format (role tags after [gMASK]<sop>; thinking switchable).
_GLM_CHAT_TEMPLATE = r"""[gMASK]<sop>
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unsupported role: ' + message['role']) }}
    {%- endif %}
    {%- set tag = '<|observation|>' if message['role'] == 'tool' else '<|' + message['role'] + '|>' %}
    {{- tag + '\n' + message['content'] }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think></think>' }}
    {%- endif %}
{%- endif %}
"""

# DeepSeek-V3's chat format (full-width bars and the U+2581 separator, as published).
_DEEPSEEK_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- message['content'] }}
    {%- elif message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}
    {%- else %}
        {{- raise_exception('unsupported role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜>' }}
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
class Family:
    """What differs between the families besides the network."""

    model_type: str
    special_tokens: tuple[tuple[str, bool], ...]  # (token, special flag) in id order
    bos: str | None
    eos: str
    pad: str | None
    generation_eos: tuple[str, ...]
    chat_template: str


FAMILIES = {
    "LlamaForCausalLM": Family(
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
    "Qwen3ForCausalLM": Family(
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
    "GlmMoeDsaForCausalLM": Family(
        model_type="glm_moe_dsa",
        special_tokens=(
            ("<|endoftext|>", True),
            ("[MASK]", True),
            ("[gMASK]", True),
            ("[sMASK]", True),
            ("<sop>", True),
            ("<eop>", True),
            ("<|system|>", True),
            ("<|user|>", True),
            ("<|assistant|>", True),
            ("<|observation|>", True),
            ("<think>", False),
            ("</think>", False),
            ("<tool_call>", False),
            ("</tool_call>", False),
        ),
        bos=None,
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
        chat_template=_GLM_CHAT_TEMPLATE,
    ),
}
_DEEPSEEK = Family(
    model_type="deepseek_v3",
    special_tokens=(
        ("<｜begin▁of▁sentence｜>", True),
        ("<｜end▁of▁sentence｜>", True),
        ("<｜User｜>", True),
        ("<｜Assistant｜>", True),
        ("<think>", False),
        ("</think>", False),
    ),
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    pad="<｜end▁of▁sentence｜>",
    generation_eos=("<｜end▁of▁sentence｜>",),
    chat_template=_DEEPSEEK_CHAT_TEMPLATE,
)
FAMILIES["DeepseekV3ForCausalLM"] = _DEEPSEEK
FAMILIES["DeepseekV32ForCausalLM"] = replace(_DEEPSEEK, model_type="deepseek_v32")


def family(arch: str) -> Family:
    """The family of ``arch``; an unknown architecture is a ValueError listing the known."""
    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    return FAMILIES[arch]


SMALL_VOCAB = 4096  # above this, the tokenizer is trained to the model's full vocabulary


def _pseudo_words(n: int, seed: int = 0) -> list[str]:
    """Lines of ``n`` distinct-enough lower-case pseudo-words, each line twice."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 13, size=n)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    text = letters[rng.integers(0, 26, size=int(lengths.sum()))].tobytes().decode()
    ends = np.cumsum(lengths)
    words = [text[e - n_ : e] for e, n_ in zip(ends.tolist(), lengths.tolist(), strict=True)]
    lines = [" ".join(words[i : i + 20]) for i in range(0, n, 20)]
    return lines + lines


def build_tokenizer(arch: str, vocab_size: int = 512) -> _Backend:
    """A byte-level BPE of ``vocab_size`` ids (special tokens last), deterministic: at
    most that many for small sizes, exactly that many above :data:`SMALL_VOCAB`."""
    fam = family(arch)
    n_special = len(fam.special_tokens)
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
    corpus = _CORPUS.splitlines()
    if vocab_size > SMALL_VOCAB:
        corpus += _pseudo_words(2 * vocab_size)
    tok.train_from_iterator(corpus, trainer)
    for token, special in fam.special_tokens:
        added = AddedToken(token, special=special, normalized=False)
        if special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    if fam.bos is not None:
        bos_id = tok.token_to_id(fam.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos}:0 $A:0",
            pair=f"{fam.bos}:0 $A:0 {fam.bos}:1 $B:1",
            special_tokens=[(fam.bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if vocab_size > SMALL_VOCAB and tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(  # the synthetic corpus is sized so this cannot happen
            f"the tokenizer reached {tok.get_vocab_size(with_added_tokens=True)} tokens, "
            f"not {vocab_size}"
        )
    return tok


def tokenizer_files(arch: str, tok: _Backend, max_len: int) -> dict[str, dict[str, Any]]:
    """The JSON files next to ``tokenizer.json``: file name → content."""
    fam = family(arch)
    named = {"bos_token": fam.bos, "eos_token": fam.eos, "pad_token": fam.pad}
    named = {k: v for k, v in named.items() if v is not None}
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": fam.bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": fam.chat_template,
    }
    generation: dict[str, Any] = {}
    if fam.bos is not None:
        generation["bos_token_id"] = token_id(tok, fam.bos)
    generation["eos_token_id"] = [token_id(tok, t) for t in fam.generation_eos]
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": dict(named),
        "generation_config.json": generation,
    }


def token_id(tok: _Backend, token: str) -> int:
    """The id of ``token``; a ValueError when the tokenizer lacks it."""
    found = tok.token_to_id(token)
    if found is None:
        raise ValueError(f"token {token!r} is not in the generated tokenizer")
    return int(found)
