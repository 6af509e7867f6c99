"""Random dataset: exact lengths, shared prefix, determinism, tokenizer semantics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.bench.datasets import sample_random_requests
from pdserve.bench.errors import BenchError
from pdserve.bench.tokenizer import BenchTokenizer, load_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "serving large language models with disaggregated prefill and decode",
    "time to first token and time per output token are service level objectives",
    "a benchmark client sends requests at a fixed rate and measures latency",
] * 20


def _bpe_dir(folder: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}'
    )
    return folder


def test_tokenizer_view(tiny_tokenizer_dir: Path, make_tiny_tokenizer: Callable[..., Path]) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    assert tok.vocab_size == 63  # [UNK] [BOS] [EOS] + 60 words; <|end|> is an added token
    assert tok.all_special_ids == [0, 1, 2, 63]
    assert tok.num_special_tokens_to_add() == 1
    assert tok.encode("a1 a2", add_special_tokens=True) == [1, 4, 5]
    assert tok.encode("a1 a2") == [4, 5]
    assert tok.decode([1, 4, 5]) == "[BOS] a1 a2"  # special tokens kept
    # tokenizer.json's post-processor decides (transformers 5), not add_bos_token ...
    pp_wins = load_tokenizer(str(make_tiny_tokenizer("pp", add_bos=False)))
    assert pp_wins.num_special_tokens_to_add() == 1
    # ... which only applies when tokenizer.json has no post-processor
    for add_bos in (True, False):
        folder = make_tiny_tokenizer(f"nopp{add_bos}", add_bos=add_bos, post_processor=False)
        no_pp = load_tokenizer(str(folder))
        assert no_pp.num_special_tokens_to_add() == int(add_bos)
        assert no_pp.encode("a1", add_special_tokens=True) == [1, 4][1 - int(add_bos) :]
    assert load_tokenizer(str(tiny_tokenizer_dir / "tokenizer.json")).vocab_size == 63
    with pytest.raises(BenchError, match="tokenizer"):
        load_tokenizer(str(tiny_tokenizer_dir / "missing"))


def test_exact_lengths_and_prefix(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    reqs = sample_random_requests(tok, 40, input_len=21, output_len=7, prefix_len=5, seed=3)
    assert [r.request_id for r in reqs[:2]] == ["0", "1"]
    prefixes = set()
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert r.prompt_len == len(ids) == 5 + 20  # L' = 21 - 1 special token
        assert r.expected_output_len == 7
        assert not set(ids) & set(tok.all_special_ids)
        prefixes.add(tuple(ids[:5]))
        body = ids[5:]  # allowed[(offset + i + arange(L)) % |allowed|]: consecutive ids
        assert all((b - a) % 60 == 1 for a, b in zip(body, body[1:], strict=False))
    assert len(prefixes) == 1
    assert len({r.prompt for r in reqs}) > 1


def test_range_ratio_bounds(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    reqs = sample_random_requests(tok, 300, input_len=21, output_len=10, range_ratio=0.5, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) == 10 and max(ins) == 30  # [floor(20*.5), ceil(20*1.5)]
    assert min(outs) == 5 and max(outs) == 15
    ones = sample_random_requests(tok, 5, input_len=21, output_len=0, seed=0)
    assert {r.expected_output_len for r in ones} == {1}  # output floor of 1


def test_deterministic_for_seed(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    a = sample_random_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, seed=7)
    b = sample_random_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, seed=7)
    c = sample_random_requests(tok, 10, input_len=30, output_len=5, range_ratio=0.3, seed=8)
    assert a == b
    assert a != c


def test_validation(tiny_tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    with pytest.raises(BenchError, match="too small"):
        sample_random_requests(tok, 1, input_len=1, output_len=1)  # 1 - 1 special = 0
    with pytest.raises(BenchError, match="range-ratio"):
        sample_random_requests(tok, 1, input_len=10, output_len=1, range_ratio=1.0)


def test_bpe_retokenization_invariant(tmp_path: Path) -> None:
    tok = load_tokenizer(str(_bpe_dir(tmp_path / "bpe")))
    assert tok.num_special_tokens_to_add() == 0
    reqs = sample_random_requests(tok, 30, input_len=64, output_len=4, prefix_len=8, seed=1)
    for r in reqs:  # byte-level BPE may not round-trip; the count is always the true one
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert abs(r.prompt_len - 72) <= 4


def test_matches_transformers_tokenizer(
    tiny_tokenizer_dir: Path, make_tiny_tokenizer: Callable[..., Path], tmp_path: Path
) -> None:
    """Same prompts as vLLM would build with a transformers tokenizer (when installed)."""
    transformers = pytest.importorskip("transformers")
    variants = (
        tiny_tokenizer_dir,
        make_tiny_tokenizer("pp", add_bos=False),
        make_tiny_tokenizer("nopp", add_bos=False, post_processor=False),
        _bpe_dir(tmp_path / "b"),
    )
    for folder in variants:
        ours: BenchTokenizer = load_tokenizer(str(folder))
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        assert ours.vocab_size == hf.vocab_size
        assert ours.num_special_tokens_to_add() == hf.num_special_tokens_to_add()
        assert set(hf.all_special_ids) <= set(ours.all_special_ids)
        kw: dict[str, Any] = {
            "num_requests": 12,
            "input_len": 40,
            "output_len": 3,
            "range_ratio": 0.25,
        }
        assert sample_random_requests(ours, prefix_len=4, seed=5, **kw) == sample_random_requests(
            hf, prefix_len=4, seed=5, **kw
        )
