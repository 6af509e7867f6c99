"""pdserve.frontend.tokenizer against transformers.AutoTokenizer on the generated checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.frontend.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
TEXTS = [
    "Hello, world!",
    "The quick brown fox  jumps\n\nover 12345 lazy dogs.\t",
    " leading and trailing spaces  ",
    "ünïcödé ✓ 漢字 and emoji 🙂",
    "",
    "they'll say it's fine, won't they?",
    "<|begin_of_text|>inline<|eot_id|> <|im_start|>user\nhi<|im_end|>",
    "<think>\nreasoning</think>answer",
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there!  "},
    {"role": "assistant", "content": "Hello.", "tool_calls": None},
    {"role": "user", "content": "What is 2+2?"},
]


def _pair(d: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "config.json"):  # fmt: skip
        shutil.copy(src / name, dst / name)
    return dst


def _edit_config(d: Path, **changes: Any) -> None:
    path = d / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _assert_same(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
            assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(arch: str, tiny_ckpts: dict[str, Path]) -> None:
    ours, hf = _pair(tiny_ckpts[arch])
    _assert_same(ours, hf)
    for gen in (True, False):
        assert ours.apply_chat_template(
            MESSAGES, add_generation_prompt=gen
        ) == hf.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, enable_thinking=False) == hf.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(arch: str, tiny_ckpts: dict[str, Path]) -> None:
    tok = Tokenizer.from_pretrained(tiny_ckpts[arch])
    for text in TEXTS:
        assert (
            tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)
            == text
        )


def test_special_tokens(tiny_ckpts: dict[str, Path]) -> None:
    llama = Tokenizer.from_pretrained(tiny_ckpts["LlamaForCausalLM"])
    qwen = Tokenizer.from_pretrained(tiny_ckpts["Qwen3ForCausalLM"])
    assert llama.encode("hi")[0] == llama.bos_token_id
    assert llama.encode("hi", add_special_tokens=False)[0] != llama.bos_token_id
    assert qwen.bos_token_id is None and qwen.encode("hi") == qwen.encode(
        "hi", add_special_tokens=False
    )
    ids = llama.convert_tokens_to_ids(["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"])
    assert llama.eos_token_ids == frozenset(ids)
    assert qwen.eos_token_ids == frozenset(
        qwen.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    )
    think = qwen.convert_tokens_to_ids(["<think>"])[0]
    assert think not in qwen.all_special_ids and qwen.eos_token_id in qwen.all_special_ids
    assert qwen.decode(qwen.encode("<think>x<|im_end|>")) == "<think>x"  # only special ones skipped
    assert llama.chat_template is not None and len(llama) == llama.vocab_size


@pytest.mark.parametrize(
    ("arch", "add_bos"),
    [("LlamaForCausalLM", None), ("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True)],
)
def test_post_processor_decides_bos_like_transformers(
    arch: str, add_bos: bool | None, tiny_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """tokenizer.json's post-processor wins over add_bos_token, as in transformers 5."""
    d = _copy_tokenizer(tiny_ckpts[arch], tmp_path / "tok")
    _edit_config(d, add_bos_token=add_bos, add_eos_token=None)
    ours, hf = _pair(d)
    _assert_same(ours, hf)
    assert ours.add_bos_token == (arch == "LlamaForCausalLM")


def test_flags_apply_without_post_processor(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = _copy_tokenizer(tiny_ckpts["LlamaForCausalLM"], tmp_path / "tok")
    tok_json = json.loads((d / "tokenizer.json").read_text())
    tok_json["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tok_json))
    for add_bos, add_eos in ((True, False), (False, True), (None, None)):
        _edit_config(d, add_bos_token=add_bos, add_eos_token=add_eos)
        tok = Tokenizer.from_pretrained(d)
        plain = tok.encode("hi", add_special_tokens=False)
        expected = [tok.bos_token_id] * bool(add_bos) + plain + [tok.eos_token_id] * bool(add_eos)
        assert tok.encode("hi") == expected and tok.add_bos_token == bool(add_bos)


def test_named_templates_and_jinja_file(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    d = _copy_tokenizer(tiny_ckpts["Qwen3ForCausalLM"], tmp_path / "tok")
    default = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
    tool_use = (
        "{% for t in tools %}{{ t['name'] }};{% endfor %}{{ messages[0]['content'] | tojson }}"
    )
    _edit_config(
        d,
        chat_template=[
            {"name": "default", "template": default},
            {"name": "tool_use", "template": tool_use},
        ],
    )
    ours, hf = _pair(d)
    assert ours.chat_template == default and ours.chat_template_names == ["default", "tool_use"]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "café <b>"}]
    tools = [{"name": "search"}, {"name": "calc"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    rendered = ours.apply_chat_template(msgs, tools=tools)
    assert rendered == 'search;calc;"café <b>"'
    assert rendered == hf.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert ours.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == '"café <b>"'
    (d / "chat_template.jinja").write_text("{{ bos_token is defined }}|{{ eos_token }}")
    assert Tokenizer.from_pretrained(d).apply_chat_template(msgs) == "False|<|im_end|>"


def test_errors(tiny_ckpts: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)
    d = _copy_tokenizer(tiny_ckpts["LlamaForCausalLM"], tmp_path / "tok")
    tok = Tokenizer.from_pretrained(d)
    with pytest.raises(ValueError, match="unsupported role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="non-empty"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="not valid jinja"):
        tok.apply_chat_template(MESSAGES, chat_template="{% for %}")
    _edit_config(d, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(d).apply_chat_template(MESSAGES)
    _edit_config(d, add_bos_token="yes")
    with pytest.raises(ValueError, match="add_bos_token"):
        Tokenizer.from_pretrained(d)


@pytest.mark.parametrize("arch", ARCHS)
def test_max_chars_per_token_bounds_the_token_count(arch: str, tiny_ckpts: dict[str, Path]) -> None:
    """``ceil(len(text) / max_chars_per_token)`` never exceeds the real token count, even
    for texts made of the longest tokens."""
    import random

    from pdserve.frontend.processor import min_token_count

    tok = Tokenizer.from_pretrained(tiny_ckpts[arch])
    per = tok.max_chars_per_token
    assert isinstance(per, int) and per >= 1
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    decoded_longest = max(
        (tok.decode([i], skip_special_tokens=False) for i in vocab.values()), key=len
    )
    rng = random.Random(0)
    alphabet = "ab c\n\t.,!漢字ünï🙂<|>" + "".join(vocab)
    texts = [
        *TEXTS,
        decoded_longest * 40,
        max(vocab, key=len) * 40,
        " " * 4000,
        "\n" * 500,
        "a" * 5000,
        "🙂" * 500,
        *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(20)),
    ]
    for text in texts:
        n = len(tok.encode(text, add_special_tokens=False))
        assert min_token_count(tok, text) <= n, (text[:40], n, per)
    assert min_token_count(tok, decoded_longest * 40) >= 40 * len(decoded_longest) // per


def test_max_chars_per_token_is_none_where_text_can_vanish() -> None:
    """No bound where a normalizer, pre-tokenizer or model can drop characters or fold an
    unbounded run into one token; a factor where a normalizer composes characters."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    from pdserve.frontend.tokenizer import max_chars_per_token

    byte_tokens = {f"<0x{b:02X}>": 3 + b for b in range(256)}
    fallback = Backend(
        models.BPE({"a": 0, "b": 1, "ab": 2, **byte_tokens}, [("a", "b")], byte_fallback=True)
    )
    assert max_chars_per_token(fallback) == 6  # "<0x41>"
    fallback.normalizer = normalizers.NFC()
    assert max_chars_per_token(fallback) == 24  # NFC composes up to 4 characters into one
    fallback.normalizer = normalizers.Replace(" ", "▁")
    assert max_chars_per_token(fallback) == 6
    for norm in (normalizers.Strip(), normalizers.Replace("ab", ""), normalizers.BertNormalizer()):
        fallback.normalizer = norm
        assert max_chars_per_token(fallback) is None, norm
    fallback.normalizer = None
    fallback.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    assert max_chars_per_token(fallback) == 6
    for pre in (pre_tokenizers.Whitespace(), pre_tokenizers.Split(" ", "removed")):
        fallback.pre_tokenizer = pre
        assert max_chars_per_token(fallback) is None, pre
    dropping = Backend(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    assert dropping.encode("abxxxxab").ids == [2, 2]  # unknown characters vanish
    assert max_chars_per_token(dropping) is None
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3}
    fused = Backend(models.BPE(vocab, [("a", "b")], unk_token="<unk>", fuse_unk=True))
    assert max_chars_per_token(fused) is None
    unfused = Backend(models.BPE(vocab, [("a", "b")], unk_token="<unk>", fuse_unk=False))
    assert max_chars_per_token(unfused) == 5
    wordpiece = Backend(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert max_chars_per_token(wordpiece) is None
