"""The official ``openai`` client against the API server (fake engine, real uvicorn)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.core_types.kv_transfer_params import KVTransferParams

from .conftest import MODEL, FakeEngineClient, ServerFactory, ServerThread, signed


def client_for(srv: ServerThread, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=api_key, max_retries=0, timeout=10)


def test_completion_non_streaming(server: ServerThread) -> None:
    r = client_for(server).completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert r.choices[0].text == "abcde"
    assert r.choices[0].finish_reason == "length"
    assert r.model == MODEL
    assert r.id.startswith("cmpl-")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 5, 11)
    assert r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 3


def test_completion_token_prompt_and_default_model(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL
    assert body["choices"][0]["text"] == "abc"
    assert body["usage"]["prompt_tokens"] == 2


def test_completion_echo_text_and_token_prompts(server: ServerThread) -> None:
    c = client_for(server)
    r = c.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True)
    assert r.choices[0].text == "helloabc"
    assert r.usage is not None and r.usage.completion_tokens == 3
    r = c.completions.create(model=MODEL, prompt=[104, 105], max_tokens=2, echo=True)
    assert r.choices[0].text == "hiab"
    stream = c.completions.create(model=MODEL, prompt="yo", max_tokens=3, echo=True, stream=True)
    texts = [ch.choices[0].text for ch in stream if ch.choices]
    assert texts[0] == "yoa" and "".join(texts) == "yoabc"


def test_completion_streaming_with_usage(server: ServerThread) -> None:
    stream = client_for(server).completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "abcd"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 4)
    assert last.usage.total_tokens == 7


def test_chat_non_streaming(server: ServerThread) -> None:
    r = client_for(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
    )
    msg = r.choices[0].message
    assert (msg.role, msg.content) == ("assistant", "abc")
    assert r.id.startswith("chatcmpl-")
    assert r.usage is not None
    # "<|user|>hi\n<|assistant|>": 23 characters, no BOS for chat
    assert r.usage.prompt_tokens == len("<|user|>hi\n<|assistant|>")
    assert r.usage.completion_tokens == 3


def test_chat_streaming_with_usage(server: ServerThread) -> None:
    stream = client_for(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "abcde"
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_sse_framing_ends_with_done(server: ServerThread, path: str) -> None:
    body: dict = {"model": MODEL, "max_tokens": 3, "stream": True}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["usage"] is None for p in payloads)  # no include_usage: no usage chunk
    assert len(payloads) == 3


def test_continuous_usage_stats(server: ServerThread) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json=body)
    payloads = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert [p["usage"]["completion_tokens"] for p in payloads] == [1, 2, 3, 3]


def test_cached_tokens_only_when_enabled(
    engine: FakeEngineClient, make_server: ServerFactory
) -> None:
    srv = make_server(engine, enable_prompt_tokens_details=False)
    r = client_for(srv).completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is None


def test_sampling_fields_reach_the_engine(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    r = client_for(server).completions.create(
        model=MODEL,
        prompt="hey",
        max_tokens=10,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["zz"],
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [ord("c")],
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "repetition_penalty": 1.0,
        },
        extra_headers={"X-Request-Id": "sampling-1"},
    )
    assert r.choices[0].text == "abc"  # stopped by stop_token_ids
    assert r.choices[0].finish_reason == "stop"
    _, params, _ = server_engine.requests["sampling-1"]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert (params.seed, params.min_tokens, params.ignore_eos) == (7, 2, True)
    assert params.stop == ["zz"] and params.stop_token_ids == [99]
    assert params.skip_special_tokens is False and params.include_stop_str_in_output is True


def test_max_tokens_none_uses_rest_of_context(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": None},
            headers={"X-Request-Id": "rest-1"},
        )
    assert r.status_code == 200
    _, params, _ = server_engine.requests["rest-1"]
    assert params.max_tokens == server_engine.max_model_len - 4
    assert r.json()["usage"]["completion_tokens"] == server_engine.max_model_len - 4


def test_logprobs(server: ServerThread) -> None:
    c = client_for(server)
    r = c.completions.create(model=MODEL, prompt="q", max_tokens=2, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["a", "b"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.text_offset == [0, 1] and lp.top_logprobs is None
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=2, logprobs=True
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(x.token, x.logprob) for x in content] == [("a", -0.5), ("b", -0.5)]  # type: ignore[union-attr]


def test_kv_transfer_params_round_trip(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    kv = {"do_remote_decode": True, "remote_host": "127.0.0.1"}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "p", "max_tokens": 1, "kv_transfer_params": signed(kv, "pd-1")},
            headers={"X-Request-Id": "pd-1"},
        )
    assert r.status_code == 200
    assert server_engine.requests["pd-1"][2] == KVTransferParams(**kv)  # typed at the edge
    assert r.json()["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_request_id": "pd-1",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
    }


@pytest.mark.parametrize(
    "kv,field",
    [
        ({"remote_port": "x"}, "kv_transfer_params.remote_port"),
        ({"do_remote_prefill": True, "remote_host": "h"}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, -2]}, "kv_transfer_params.remote_block_ids"),
        ({"bogus": 1}, "unknown field `bogus`"),
        ([1, 2], "kv_transfer_params"),
    ],
)
def test_bad_kv_transfer_params_get_400_naming_the_field(
    server: ServerThread, server_engine: FakeEngineClient, kv: object, field: str
) -> None:
    """Signed by the proxy but malformed: 400 (a non-object cannot be signed at all)."""
    body_kv = signed(kv, "bad-kv") if isinstance(kv, dict) else kv
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "p", "max_tokens": 1, "kv_transfer_params": body_kv},
            headers={"X-Request-Id": "bad-kv"},
        )
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]


def test_x_request_id_passes_through(server: ServerThread, server_engine: FakeEngineClient) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "p", "max_tokens": 1},
            headers={"X-Request-Id": "my-id-42"},
        )
        assert r.headers["x-request-id"] == "my-id-42"
        assert r.json()["id"] == "cmpl-my-id-42"
        assert "my-id-42" in server_engine.requests
        minted = c.post("/v1/completions", json={"prompt": "p", "max_tokens": 1})
        assert minted.headers["x-request-id"]
        assert minted.json()["id"] == "cmpl-" + minted.headers["x-request-id"]
        assert c.get("/v1/models", headers={"X-Request-Id": "m-1"}).headers["x-request-id"] == "m-1"


def test_models_tokenize_detokenize_version_health(server: ServerThread) -> None:
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        tok = c.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
        assert tok == {
            "count": 3,
            "max_model_len": 128,
            "tokens": [1, 104, 105],
            "token_strs": ["<s>", "h", "i"],
        }
        detok = c.post("/detokenize", json={"tokens": [104, 105]}).json()
        assert detok == {"prompt": "hi"}
        chat_tok = c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat_tok.json()["count"] == len("<|user|>x\n<|assistant|>")
        assert c.get("/version").json()["version"]
        assert c.get("/health").status_code == 200


def test_content_parts_string_and_openai_formats(
    engine: FakeEngineClient, make_server: ServerFactory
) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    srv = make_server(engine)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        ids = c.post("/tokenize", json=body).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "<|user|>a\nb\n"
    loop_template = (
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}{% endfor %}"
    )
    srv2 = make_server(engine, chat_template=loop_template)  # auto → "openai"
    with httpx.Client(base_url=srv2.url, timeout=10) as c:
        ids = c.post("/tokenize", json=body).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "a|b|"
        plain = {"messages": [{"role": "user", "content": "xy"}], "add_generation_prompt": False}
        ids = c.post("/tokenize", json=plain).json()["tokens"]  # a string becomes one part
        assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "xy|"


def test_chat_template_file_override(
    engine: FakeEngineClient, make_server: ServerFactory, tmp_path
) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    srv = make_server(engine, chat_template=str(f), chat_template_content_format="string")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"messages": [{"role": "user", "content": "q"}]}
        ids = c.post("/tokenize", json=body).json()["tokens"]
        assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "[q]"


def test_completion_with_a_list_of_prompts(make_server: ServerFactory) -> None:
    """A batch of prompts: each its own engine request, choices numbered prompt * n +
    sample (vLLM's order), usage summed, whole and streamed."""
    engine = FakeEngineClient()
    c = client_for(make_server(engine))
    one = [c.completions.create(model=MODEL, prompt=p, max_tokens=2) for p in ("hello", "hi")]
    r = c.completions.create(model=MODEL, prompt=["hello", "hi"], max_tokens=2, echo=True, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == ["helloab", "helloab", "hiab", "hiab"]
    assert r.usage is not None and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)  # type: ignore[union-attr]
    assert r.usage.completion_tokens == 8
    rid = r.id.removeprefix("cmpl-")
    assert {f"0_{rid}-0", f"1_{rid}-0", f"0_{rid}-1", f"1_{rid}-1"} <= set(engine.requests)
    r = c.completions.create(model=MODEL, prompt=[[104, 105], [104]], max_tokens=1, echo=True)
    assert [ch.text for ch in r.choices] == ["hia", "ha"]
    stream = c.completions.create(
        model=MODEL,
        prompt=["ab", "cd", "ef"],
        max_tokens=3,
        echo=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert ch.usage is None and ch.id == chunks[0].id
    assert texts == {0: "ababc", 1: "cdabc", 2: "efabc"}
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert engine.aborted == []  # every prompt's requests ran to their end
