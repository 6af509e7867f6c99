"""The API server with pdserve's real tokenizer (from a tiny random Llama checkpoint)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from .conftest import MODEL, FakeEngineClient, ServerFactory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = pytest.importorskip("pdserve.testing.checkpoint")
    d = tmp_path_factory.mktemp("tiny_llama")
    checkpoint.make_checkpoint("LlamaForCausalLM", "tiny", d, dtype="float32")
    return d


def test_chat_and_tokenize_with_real_tokenizer(llama_dir: Path, make_server: ServerFactory) -> None:
    from pdserve.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(llama_dir)
    engine = FakeEngineClient(tokenizer=tok, max_model_len=256)
    srv = make_server(engine)
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected_ids = tok.encode(rendered, add_special_tokens=False)

    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0, timeout=10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == len(expected_ids)
    assert r.choices[0].message.content == "abcd"

    c = client.completions.create(model=MODEL, prompt="hello world", max_tokens=2)
    assert c.usage is not None and c.usage.prompt_tokens == len(tok.encode("hello world"))

    with httpx.Client(base_url=srv.url, timeout=10) as h:
        t = h.post("/tokenize", json={"messages": messages}).json()
        assert t["tokens"] == expected_ids
        text = h.post("/detokenize", json={"tokens": tok.encode("hello world")}).json()["prompt"]
        assert text == "hello world"
        bad_role = {"messages": [{"role": "developer", "content": "x"}]}
        r400 = h.post("/v1/chat/completions", json=bad_role)
        assert r400.status_code == 400 and "unsupported role" in r400.json()["error"]["message"]
