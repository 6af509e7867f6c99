"""The two legs: what each upstream receives, and what the client gets back."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from _polling import wait_until

from .conftest import MODEL, PDFactory, stream_raw

pytestmark = pytest.mark.timeout(30)


def test_bodies_and_request_id_on_both_legs(make_pd: PDFactory) -> None:
    pd = make_pd()
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 7,
        "min_tokens": 2,
        "temperature": 0.0,
        "stream": False,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(pd.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "t0t1t2t3"
    (p,) = pd.prefill[0].seen
    (d,) = pd.decode[0].seen
    # prefill leg: one token, not streamed, asks for a remote decode
    assert p.path == d.path == "/v1/completions"
    assert p.body["max_tokens"] == 1
    assert p.body["stream"] is False
    assert "stream_options" not in p.body and "min_tokens" not in p.body
    assert p.body["prompt"] == "hello" and p.body["temperature"] == 0.0
    assert p.kv == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # decode leg: the client's body plus the prefill's params, signed by the proxy
    rid = p.headers["x-request-id"]
    assert rid and d.headers["x-request-id"] == rid == r.headers["x-request-id"]
    assert d.kv == pd.prefill[0].kv_params(rid)
    assert d.body == dict(body, kv_transfer_params=d.body["kv_transfer_params"])
    assert body["max_tokens"] == 7  # the client's dict is untouched


def test_client_request_id_is_used_on_both_legs(make_pd: PDFactory) -> None:
    pd = make_pd()
    r = httpx.post(
        pd.url + "/v1/completions",
        json={"model": MODEL, "prompt": "a", "max_tokens": 3},
        headers={"X-Request-Id": "client-id-42"},
        timeout=10,
    )
    assert r.status_code == 200
    assert pd.prefill[0].seen[0].headers["x-request-id"] == "client-id-42"
    assert pd.decode[0].seen[0].headers["x-request-id"] == "client-id-42"
    assert pd.decode[0].seen[0].kv["remote_request_id"] == "client-id-42"  # type: ignore[index]
    assert r.headers["x-request-id"] == "client-id-42"


def test_fresh_request_ids_differ(make_pd: PDFactory) -> None:
    pd = make_pd()
    for _ in range(2):
        httpx.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=10)
    ids = [s.headers["x-request-id"] for s in pd.prefill[0].seen]
    assert len(set(ids)) == 2


def test_chat_non_streaming_with_max_completion_tokens(make_pd: PDFactory) -> None:
    pd = make_pd()
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=9,
    )
    assert out.choices[0].message.content == "t0t1t2t3"
    p = pd.prefill[0].seen[0]
    assert p.path == "/v1/chat/completions"
    assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
    d = pd.decode[0].seen[0]
    assert d.body["max_completion_tokens"] == 9 and "max_tokens" not in d.body
    assert d.kv is not None and d.kv["remote_block_ids"] == [3, 1, 4, 1, 5]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_with_openai_client(make_pd: PDFactory, chat: bool) -> None:
    pd = make_pd(decode_knobs={"num_chunks": 5})
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="k", max_retries=0, timeout=10)
    texts: list[str] = []
    if chat:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            texts.extend(c.delta.content or "" for c in chunk.choices)
    else:
        cstream = client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        for cchunk in cstream:
            texts.extend(c.text for c in cchunk.choices)
    assert texts == [f"t{i}" for i in range(5)]
    p, d = pd.prefill[0].seen[0], pd.decode[0].seen[0]
    assert p.body["stream"] is False and "stream_options" not in p.body
    assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}
    assert "kv_transfer_params" in d.body


def test_stream_is_byte_exact_and_not_buffered(make_pd: PDFactory) -> None:
    pd = make_pd(decode_knobs={"num_chunks": 6, "chunk_delay": 0.15})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True}
    received, arrivals = stream_raw(pd.url, body)
    assert received == b"".join(pd.decode[0].sent_bytes)
    assert received.endswith(b"data: [DONE]\n\n")
    # the first chunk reached the client long before the stream ended
    assert len(arrivals) >= 3
    assert arrivals[0] < arrivals[-1] - 0.4


def test_least_loaded_spreads_over_two_prefill_instances(make_pd: PDFactory) -> None:
    pd = make_pd(2, 1, prefill_knobs={"delay": 0.3})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [
            ex.submit(httpx.post, pd.url + "/v1/completions", json=body, timeout=10)
            for _ in range(4)
        ]
        # while all four are in flight, each instance holds two of them
        assert wait_until(lambda: sum(len(f.seen) for f in pd.prefill) == 4)
        assert [i.in_flight for i in pd.core.prefill.instances] == [2, 2]
        assert all(f.result().status_code == 200 for f in futs)
    assert [len(f.seen) for f in pd.prefill] == [2, 2]
    assert [i.in_flight for i in pd.core.prefill.instances] == [0, 0]
    # sequential requests alternate (ties broken round-robin)
    for _ in range(2):
        httpx.post(pd.url + "/v1/completions", json=body, timeout=10)
    assert [len(f.seen) for f in pd.prefill] == [3, 3]


def test_least_loaded_decode_choice(make_pd: PDFactory) -> None:
    pd = make_pd(1, 2, decode_knobs={"num_chunks": 20, "chunk_delay": 0.05})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}
    with httpx.Client(timeout=10) as c, c.stream("POST", pd.url + "/v1/completions", json=body):
        # one long stream holds decode[0]; the next two requests both go to decode[1]
        assert wait_until(lambda: pd.core.decode.instances[0].in_flight == 1)
        for _ in range(2):
            r = httpx.post(
                pd.url + "/v1/completions",
                json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                timeout=10,
            )
            assert r.status_code == 200
        assert [len(f.seen) for f in pd.decode] == [1, 2]
