"""``n`` and ``prompt_logprobs`` through a real ``pdserve serve`` (tiny Llama, 4-token
blocks, 16-token chunks) with the official ``openai`` client: n choices on both
endpoints, streamed and not, sharing the prompt's blocks (the prefix-cache hit
counter); seeds reproduce, greedy choices are equal; prompt logprobs in vLLM's shape;
echo with logprobs returns the engine's prompt logprobs, then the sampled tokens'
(``max_tokens=0`` the prompt's alone); refusals name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.frontend.tokenizer import Tokenizer

from .conftest import LiveServer, start_server

HITS = "pdserve:prefix_cache_hits_total"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("parallel"),
        "--max-model-len", "256", "--block-size", "4", "--max-num-batched-tokens", "16",
    )  # fmt: skip
    yield srv
    srv.stop()


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0, timeout=30)


def _hits(srv: LiveServer) -> float:
    from .conftest import metric

    return metric(srv.url, HITS, missing_ok=True)


def _prompt(tiny_llama: Path, words: int) -> tuple[str, int]:
    text = " ".join(f"w{i}" for i in range(words))
    return text, len(Tokenizer.from_pretrained(tiny_llama).encode(text))


def test_completions_n_share_blocks_stream_and_not(server: LiveServer, tiny_llama: Path) -> None:
    c = _client(server)
    text, plen = _prompt(tiny_llama, 12)
    shared = 2 * ((plen - 1) // 4 * 4)  # two siblings hit choice 0's full blocks
    before = _hits(server)
    kw: Any = dict(model="tiny", prompt=text, n=3, max_tokens=5, seed=11, extra_body=NO_EOS)
    r = c.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.prompt_tokens == plen  # the prompt once
    assert r.usage.completion_tokens == 15
    assert _hits(server) - before == shared
    again = c.completions.create(**kw)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]
    assert len({ch.text for ch in r.choices}) > 1

    before = _hits(server)
    texts = ["", "", ""]
    usage = None
    for chunk in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        usage = chunk.usage or usage
    assert texts == [ch.text for ch in r.choices]
    assert usage is not None and usage.completion_tokens == 15 and usage.prompt_tokens == plen
    assert _hits(server) - before >= shared


def test_chat_n_stream_and_not(server: LiveServer) -> None:
    c = _client(server)
    msgs: Any = [{"role": "user", "content": "tell me about w1 w2 w3 w4 w5"}]
    before = _hits(server)
    r = c.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=4, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) == 1  # greedy: equal samples
    assert _hits(server) - before > 0
    roles: dict[int, int] = {}
    content = ["", "", ""]
    for chunk in c.chat.completions.create(
        model="tiny", messages=msgs, n=3, max_tokens=4, temperature=0, stream=True
    ):
        for ch in chunk.choices:
            content[ch.index] += ch.delta.content or ""
            roles[ch.index] = roles.get(ch.index, 0) + (ch.delta.role == "assistant")
    assert roles == {0: 1, 1: 1, 2: 1}  # each choice's first chunk carries the role
    assert content == [r.choices[0].message.content] * 3


# Logprobs of one text computed by two code paths (two samples of a request, a streamed
# and a whole answer) come from different batches, whose float32 sums may round apart
# (4.77e-07 was seen); they are compared within this tolerance, everything else exactly.
LOGPROB_TOL = 1e-4


def _same_logprobs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two completions ``logprobs`` objects of the same tokens."""
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=LOGPROB_TOL)
    assert a["top_logprobs"] == [
        None if t is None else pytest.approx(t, abs=LOGPROB_TOL) for t in b["top_logprobs"]
    ]


def _same_prompt_logprobs(a: list[Any], b: list[Any]) -> None:
    """Two vLLM ``prompt_logprobs`` lists of the same prompt."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert list(x) == list(y)
        for key, entry in x.items():
            other = y[key]
            assert (entry["rank"], entry["decoded_token"]) == (
                other["rank"],
                other["decoded_token"],
            )
            assert entry["logprob"] == pytest.approx(other["logprob"], abs=LOGPROB_TOL)


def test_prompt_logprobs_completions_and_chat(server: LiveServer, tiny_llama: Path) -> None:
    text, plen = _prompt(tiny_llama, 20)  # longer than a 16-token chunk
    body = {"model": "tiny", "prompt": text, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    ids = Tokenizer.from_pretrained(tiny_llama).encode(text)
    for choice in r["choices"]:
        plp = choice["prompt_logprobs"]
        assert len(plp) == plen and plp[0] is None
        for pos in range(1, plen):
            entry = plp[pos]
            first = next(iter(entry))
            assert first == str(ids[pos]) and entry[first]["rank"] >= 1
            assert {v["rank"] for k, v in entry.items() if k != first} <= {1, 2}
            assert len(entry) in (2, 3) and all(v["logprob"] <= 0 for v in entry.values())
            assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    _same_prompt_logprobs(r["choices"][0]["prompt_logprobs"], r["choices"][1]["prompt_logprobs"])
    assert r["usage"]["prompt_tokens"] == plen
    # streamed: with the first chunk of each choice
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as s:
        got = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
    firsts = [ln for ln in got if '"prompt_logprobs"' in ln]
    assert len(firsts) == 2
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    cr = httpx.post(
        f"{server.url}/v1/chat/completions", json={**chat, "prompt_logprobs": 0}, timeout=30
    ).json()
    plp = cr["prompt_logprobs"]
    assert plp[0] is None and len(plp) == cr["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in plp[1:])  # N=0: the actual token only
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**chat, "prompt_logprobs": 1, "stream": True},
        timeout=30,
    ) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
    assert '"prompt_logprobs"' in lines[0] and all(
        '"prompt_logprobs"' not in ln for ln in lines[1:]
    )


def _completion(srv: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_echo_logprobs_are_the_engines(server: LiveServer, tiny_llama: Path) -> None:
    text, plen = _prompt(tiny_llama, 20)  # longer than a 16-token chunk
    base = {"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0, **NO_EOS}
    scored = _completion(server, {**base, "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    plain = _completion(server, {**base, "logprobs": 2})["choices"][0]["logprobs"]
    echo = _completion(server, {**base, "logprobs": 2, "echo": True, "n": 2})
    ids = Tokenizer.from_pretrained(tiny_llama).encode(text)
    approx = lambda v: pytest.approx(v, abs=1e-4)  # noqa: E731
    for choice in echo["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == plen + 3 and choice["text"].startswith(text)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, plen):
            entry = scored[pos]
            assert lp["token_logprobs"][pos] == approx(entry[str(ids[pos])]["logprob"])
            assert lp["tokens"][pos] == entry[str(ids[pos])]["decoded_token"]
            top = {v["decoded_token"]: v["logprob"] for v in entry.values()}
            assert lp["top_logprobs"][pos] == approx(top)
        assert lp["tokens"][plen:] == plain["tokens"]
        assert lp["token_logprobs"][plen:] == approx(plain["token_logprobs"])
        assert lp["top_logprobs"][plen:] == [approx(t) for t in plain["top_logprobs"]]
        lens = [len(t) for t in lp["tokens"]]
        assert lp["text_offset"] == [sum(lens[:j]) for j in range(plen + 3)]
        assert choice.get("prompt_logprobs") is None
    _same_logprobs(echo["choices"][0]["logprobs"], echo["choices"][1]["logprobs"])  # greedy
    # streamed: the first chunk carries the prompt's tokens and logprobs
    streamed = {**base, "logprobs": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, timeout=30) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    merged: dict[str, list[Any]] = {k: [] for k in echo["choices"][0]["logprobs"]}
    for chunk in chunks:
        for key in merged:
            merged[key] += chunk["choices"][0]["logprobs"][key]
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == plen + 1
    _same_logprobs(merged, echo["choices"][0]["logprobs"])
    # max_tokens=0: the prompt alone, scored
    zero = _completion(server, {**base, "max_tokens": 0, "logprobs": 1, "echo": True})
    choice = zero["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0
    want = echo["choices"][0]["logprobs"]["token_logprobs"][:plen]
    got = choice["logprobs"]["token_logprobs"]
    assert len(got) == plen and got[0] is None and got[1:] == approx(want[1:])


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"n": 2, "best_of": 3}, "best_of", "best_of must equal n"),
        ({"n": 65}, "n", "[1, 64]"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", ""),
    ],
)
def test_refusals(server: LiveServer, body: dict, param: str, needle: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, **body}, timeout=30
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"]
