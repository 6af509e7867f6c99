"""``/v1/completions`` with ``echo`` and ``logprobs`` (and ``max_tokens=0``) through the
API server (fake engine: output token i is ``'a' + i`` at -0.5 with the ids after it as
alternatives; prompt logprobs from :func:`fake_prompt_logprobs`). The echoed prompt's
logprobs lead each choice's, streamed or not, for n > 1 and token-id prompts; a P/D
decode leg refuses them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import (
    FakeEngineClient,
    FakeTokenizer,
    ServerFactory,
    fake_prompt_logprobs,
    prompt_ids_of,
    signed,
)

DECODE_KV = {
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_request_id": "p-1",
    "remote_host": "127.0.0.1",
    "remote_port": 7777,
}


def _post(url: str, body: dict[str, Any], rid: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=10)


def _stream(url: str, body: dict[str, Any], rid: str) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": rid},
        timeout=10,
    ) as s:
        assert s.status_code == 200, s.read()
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: {")]
    return [json.loads(ln) for ln in lines]


def _prompt_part(ids: list[int], n: int) -> dict[str, list[Any]]:
    """What the echoed prompt's logprobs must be, from the engine's prompt logprobs."""
    names = [FakeTokenizer().decode([t], skip_special_tokens=False) for t in ids]
    plp = fake_prompt_logprobs(ids, n)
    values: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for tid, entry in zip(ids[1:], plp[1:], strict=True):
        assert entry is not None
        values.append(entry[tid].logprob)
        top = {
            FakeTokenizer().decode([t], skip_special_tokens=False): lp.logprob
            for t, lp in entry.items()
            if t == tid or (lp.rank or 99) <= n
        }
        tops.append(top)
    return {"tokens": names, "token_logprobs": values, "top_logprobs": tops}


def _merged(chunks: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """One choice's text, logprobs (concatenated) and finish reason from stream chunks."""
    text, finish = "", None
    lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    lp["text_offset"] = []
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != index:
                continue
            text += c["text"]
            finish = c["finish_reason"] or finish
            for key in lp:
                lp[key] += (c["logprobs"] or {}).get(key) or []
    return {"text": text, "logprobs": lp, "finish_reason": finish}


def test_echo_logprobs_cover_prompt_then_completion(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    body = {"prompt": "hey", "max_tokens": 3, "logprobs": 2, "echo": True}
    r = _post(srv.url, body, "e1")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "heyabc" and choice["finish_reason"] == "length"
    assert choice.get("prompt_logprobs") is None  # asked for internally, not by the client
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "h", "e", "y", "a", "b", "c"]
    assert lp["token_logprobs"] == [None, -0.5, -4.0, -0.25, -0.5, -0.5, -0.5]
    assert lp["top_logprobs"] == [
        None,
        {"1": -0.25, "h": -0.5},
        {"2": -0.25, "3": -0.5, "e": -4.0},  # below the top 2: added, as a sampled one is
        {"y": -0.25, "4": -0.5},
        {"a": -0.5, "b": -1.5},
        {"b": -0.5, "c": -1.5},
        {"c": -0.5, "d": -1.5},
    ]
    assert lp["text_offset"] == [0, 3, 4, 5, 6, 7, 8]  # continuous: "<s>" is 3 long
    params = engine.requests["e1"][1]
    assert params.prompt_logprobs == 2 and params.logprobs == 2 and params.max_tokens == 3
    # the completion's part equals the same request's without echo
    plain = _post(srv.url, {**body, "echo": False}, "e2").json()["choices"][0]["logprobs"]
    assert {k: v[4:] for k, v in lp.items() if k != "text_offset"} == {
        k: v for k, v in plain.items() if k != "text_offset"
    }
    assert engine.requests["e2"][1].prompt_logprobs is None


@pytest.mark.parametrize("n", [1, 2])
def test_echo_stream_equals_whole_answer(make_server: ServerFactory, n: int) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    body = {"prompt": "a longer prompt", "max_tokens": 4, "logprobs": 3, "echo": True, "n": n}
    whole = _post(srv.url, body, f"w{n}").json()["choices"]
    chunks = _stream(srv.url, body, f"s{n}")
    ids = FakeTokenizer().encode("a longer prompt")
    expected = _prompt_part(ids, 3)
    for i in range(n):
        got = whole[i]
        lp = got["logprobs"]
        assert got["text"].startswith("a longer prompt") and len(lp["tokens"]) == len(ids) + 4
        assert {k: v[: len(ids)] for k, v in lp.items() if k != "text_offset"} == expected
        offsets = lp["text_offset"]
        assert offsets == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(offsets))]
        streamed = _merged(chunks, i)
        assert streamed == {k: got[k] for k in ("text", "logprobs", "finish_reason")}
        first = next(c for ch in chunks for c in ch["choices"] if c["index"] == i)
        assert first["text"].startswith("a longer prompt")
        assert len(first["logprobs"]["tokens"]) == len(ids) + 1  # the prompt and one token
    # the prompt's logprobs are computed once, by choice 0 (sharing its KV otherwise)
    asked = {rid: p.prompt_logprobs for rid, (_, p, _) in engine.requests.items()}
    if n == 1:
        assert asked == {"w1": 3, "s1": 3}
    else:
        assert asked == {"0_w2": 3, "1_w2": None, "0_s2": 3, "1_s2": None}


def test_echo_logprobs_token_prompt_zero_and_client_prompt_logprobs(
    make_server: ServerFactory,
) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    body: dict[str, Any] = {"prompt": [104, 105], "max_tokens": 1, "logprobs": 0, "echo": True}
    choice = _post(srv.url, body, "t0").json()["choices"][0]
    assert choice["text"] == "hia"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["h", "i", "a"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == [None, -4.0, -0.5] and lp["top_logprobs"] is None
    assert engine.requests["t0"][1].prompt_logprobs == 0  # logprobs=0: the actual token only
    # the client's own prompt_logprobs=1 < logprobs=3: the engine computes 3, the
    # choice's prompt_logprobs keep 1, the echoed logprobs 3
    body = {"prompt": "hey", "max_tokens": 1, "logprobs": 3, "echo": True, "prompt_logprobs": 1}
    choice = _post(srv.url, body, "t1").json()["choices"][0]
    assert engine.requests["t1"][1].prompt_logprobs == 3
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and [sorted(e) for e in plp[1:]] == [
        ["104", "49"],
        ["101", "50"],
        ["121"],
    ]
    assert plp[2]["101"] == {"logprob": -0.75, "rank": 3, "decoded_token": "e"}
    assert choice["logprobs"]["top_logprobs"][2] == {"2": -0.25, "3": -0.5, "e": -0.75}


def test_echo_max_tokens_zero_scores_the_prompt(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    body = {"prompt": "hey", "max_tokens": 0, "logprobs": 1, "echo": True, "n": 2}
    r = _post(srv.url, body, "z1")
    assert r.status_code == 200, r.text
    answer = r.json()
    expected = _prompt_part(FakeTokenizer().encode("hey"), 1)
    for choice in answer["choices"]:
        assert choice["text"] == "hey" and choice["finish_reason"] == "length"
        assert {k: v for k, v in choice["logprobs"].items() if k != "text_offset"} == expected
        assert choice["logprobs"]["text_offset"] == [0, 3, 4, 5]
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (4, 0, 4)
    assert engine.requests["0_z1"][1].max_tokens == 1  # one token sampled, left out
    body = {**body, "n": 1, "stream_options": {"include_usage": True}}
    chunks = _stream(srv.url, body, "z2")
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["hey"]  # one chunk, then usage
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert _merged(chunks, 0)["logprobs"] == answer["choices"][0]["logprobs"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    # without logprobs: the prompt's text alone, nothing asked of the engine
    choice = _post(srv.url, {"prompt": [104, 105], "max_tokens": 0, "echo": True}, "z3").json()
    assert choice["choices"][0]["text"] == "hi" and choice["choices"][0]["logprobs"] is None
    assert engine.requests["z3"][1].prompt_logprobs is None
    # the one token sampled hit a stop: still no token, and "length"
    body = {"prompt": "hey", "max_tokens": 0, "echo": True, "stop_token_ids": [ord("a")]}
    choice = _post(srv.url, body, "z4").json()["choices"][0]
    got = (choice["text"], choice["finish_reason"], choice["stop_reason"])
    assert got == ("hey", "length", None)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_max_tokens_zero_refusals(make_server: ServerFactory, body: dict, param: str) -> None:
    engine = FakeEngineClient()
    r = _post(make_server(engine).url, {"prompt": "x", **body}, "bad")
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert engine.requests == {}


def test_echo_logprobs_on_pd_legs(make_server: ServerFactory) -> None:
    engine = FakeEngineClient()
    srv = make_server(engine)
    body = {"prompt": "q", "max_tokens": 2, "logprobs": 1, "echo": True}
    kv = signed(DECODE_KV, "pd1", prompt_ids_of(srv.url, body))
    r = _post(srv.url, {**body, "kv_transfer_params": kv}, "pd1")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "echo"
    assert "echo=true with logprobs" in err["message"] and "do_remote_prefill" in err["message"]
    assert engine.requests == {}
    # a prefill leg computes the whole prompt: it can score it
    prefill = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": signed({"do_remote_decode": True}, "pd2"),
    }
    r = _post(srv.url, prefill, "pd2")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["<s>", "q", "a"]
