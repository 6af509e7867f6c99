"""kv_transfer_params only from the proxy, for their request, once: unsigned, forged,
tampered or expired params, params signed for another request id, params presented a
second time and decode params issued for another prompt get 403 before anything reaches
the engine; an instance without the P/D secret refuses them all; signed params pass, and
signed but malformed ones are a 400 naming the field."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.pd_auth import new_secret, sign_kv_params

from .conftest import FakeEngineClient, ServerFactory, ServerThread, prompt_ids_of, signed

DECODE_KV: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_request_id": "p-1",
    "remote_host": "10.0.0.99",  # a host the client would like the decode to dial
    "remote_port": 7777,
}


def _tampered() -> dict[str, Any]:
    kv = signed(DECODE_KV)
    kv["remote_host"] = "203.0.113.5"
    return kv


# (name, the params made when the test runs: signatures expire, so never at collection,
# which may come many minutes before the test in a full run; the reason the 403 names)
REFUSED: list[tuple[str, Callable[[], Any], str]] = [
    ("unsigned", lambda: dict(DECODE_KV), "unsigned"),
    ("prefill-hold", lambda: {"do_remote_decode": True}, "unsigned"),
    ("forged", lambda: sign_kv_params(DECODE_KV, new_secret().encode()), "did not make"),
    ("tampered", _tampered, "did not make"),
    ("expired", lambda: signed(DECODE_KV, now=time.time() - 3600), "expired"),
    ("bad-signature", lambda: {**signed(DECODE_KV), "pd_signature": "zz"}, "malformed signature"),
    ("other-request", lambda: signed(DECODE_KV, "someone-else"),
     "issued for request 'someone-else'"),
    ("no-request", lambda: signed({"do_remote_decode": True}), "issued for request None"),
]  # fmt: skip


def _body(path: str, kv: Any, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 2, "kv_transfer_params": kv, "stream": stream}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("name", "make", "reason"), REFUSED, ids=[r[0] for r in REFUSED])
def test_unverified_kv_params_are_403_and_never_reach_the_engine(
    server: ServerThread,
    server_engine: FakeEngineClient,
    path: str,
    name: str,
    make: Callable[[], Any],
    reason: str,
) -> None:
    rid = f"forged-{name}-{path.rsplit('/', 1)[-1]}"
    kv = make()
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for stream in (False, True):
            r = c.post(
                path, json=_body(path, kv, stream), headers={"X-Request-Id": f"{rid}-{stream}"}
            )
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == 403 and err["param"] == "kv_transfer_params"
            assert err["type"] == "PermissionDeniedError"
            assert reason in err["message"], err
            assert f"{rid}-{stream}" not in server_engine.requests


def test_instance_without_secret_refuses_all_kv_params(
    engine: FakeEngineClient, make_server: ServerFactory
) -> None:
    srv = make_server(engine, pd_secret=None)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/v1/completions", json=_body("/v1/completions", signed(DECODE_KV)))
        assert r.status_code == 403
        assert "PDSERVE_PD_SECRET" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=_body("/v1/completions", None)).status_code == 200
    assert len(engine.requests) == 1


def test_signed_kv_params_reach_the_engine_typed(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    body = _body("/v1/chat/completions", None)
    ids = prompt_ids_of(server.url, body)
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/chat/completions",
            json={**body, "kv_transfer_params": signed(DECODE_KV, "signed-chat-1", ids)},
            headers={"X-Request-Id": "signed-chat-1"},
        )
    assert r.status_code == 200, r.text
    digest = signed(DECODE_KV, prompt_ids=ids)["remote_prompt_digest"]
    want = KVTransferParams(**DECODE_KV, remote_prompt_digest=digest)
    assert server_engine.requests["signed-chat-1"][2] == want


def test_params_are_single_use_and_bound_to_their_prompt(
    server: ServerThread, server_engine: FakeEngineClient
) -> None:
    """The replays of the report: decode params captured once and sent again (same
    prompt), or with another prompt of the same length; prefill params sent again."""
    path = "/v1/completions"
    body = _body(path, None)
    ids = prompt_ids_of(server.url, body)
    with httpx.Client(base_url=server.url, timeout=10) as c:

        def post(rid: str, kv: dict[str, Any], prompt: str = "hi") -> httpx.Response:
            data = {**body, "prompt": prompt, "kv_transfer_params": kv}
            return c.post(path, json=data, headers={"X-Request-Id": rid})

        decode_kv = signed(DECODE_KV, "bind-1", ids)
        other = post("bind-1", decode_kv, prompt="ho")  # captured, sent with another prompt
        assert other.status_code == 403 and "another prompt" in other.text
        assert "choices" not in other.json()
        assert post("bind-1", decode_kv).status_code == 200  # (the thief spent nothing)
        for prompt in ("hi", "ho"):
            replayed = post("bind-1", decode_kv, prompt)
            assert replayed.status_code == 403, replayed.text
            assert "already used" in replayed.text or "another prompt" in replayed.text
        undigested = post("bind-3", signed(DECODE_KV, "bind-3"))
        assert undigested.status_code == 403 and "remote_prompt_digest" in undigested.text
        prefill_kv = signed({"do_remote_decode": True}, "bind-4")
        assert post("bind-4", prefill_kv).status_code == 200
        for prompt in ("hi", "another prompt entirely"):
            r = post("bind-4", prefill_kv, prompt)
            assert r.status_code == 403 and "already used" in r.text
    assert set(server_engine.requests) & {f"bind-{i}" for i in range(1, 5)} == {"bind-1", "bind-4"}


def test_signed_but_malformed_is_400(server: ServerThread, server_engine: FakeEngineClient) -> None:
    kv = signed({"do_remote_prefill": True, "remote_host": "h"}, "malformed-1")
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json=_body("/v1/completions", kv),
            headers={"X-Request-Id": "malformed-1"},
        )
    assert r.status_code == 400
    assert "kv_transfer_params.remote_block_ids" in r.json()["error"]["message"]
    assert "malformed-1" not in server_engine.requests


def test_kv_release_only_from_the_proxy(
    server: ServerThread,
    server_engine: FakeEngineClient,
    engine: FakeEngineClient,
    make_server: ServerFactory,
) -> None:
    """Releasing a request's held KV is signed like kv_transfer_params: otherwise anyone
    who learned a request id could free another client's KV before its decode read it."""
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for body in (
            {"request_id": "victim"},
            sign_kv_params({"request_id": "victim"}, new_secret().encode()),
            {**signed({"request_id": "other"}), "request_id": "victim"},  # re-targeted
            signed({"request_id": "victim"}, now=time.time() - 3600),
        ):
            r = c.post("/v1/kv_transfer/release", json=body)
            assert r.status_code == 403, (body, r.text)
            assert "KV releases" in r.json()["error"]["message"]
        assert server_engine.released == []
        release = signed({"request_id": "victim"})
        r = c.post("/v1/kv_transfer/release", json=release)
        assert r.status_code == 200, r.text
        assert server_engine.released == ["victim"]
        r = c.post("/v1/kv_transfer/release", json=release)  # replayed
        assert r.status_code == 403 and "already used" in r.text
        assert server_engine.released == ["victim"]
    srv = make_server(engine, pd_secret=None)
    r = httpx.post(f"{srv.url}/v1/kv_transfer/release", json=signed({"request_id": "x"}))
    assert r.status_code == 403 and "PDSERVE_PD_SECRET" in r.json()["error"]["message"]
    assert engine.released == []


class _LostLease(FakeEngineClient):
    """A decode engine whose pull failed: the request ends with the engine's error."""

    def generate(self, request_id, prompt, prompt_token_ids, params, kv_transfer_params=None):  # type: ignore[no-untyped-def,override]
        from pdserve.core_types.kv_connector import KV_LOAD_FAILED
        from pdserve.frontend.outputs import CompletionOutput, RequestOutput

        self.requests[request_id] = (list(prompt_token_ids), params, kv_transfer_params)
        error = f"{KV_LOAD_FAILED}: prefill no longer holds the KV of request 'p-1'"

        async def run() -> Any:
            yield RequestOutput(
                request_id,
                prompt,
                list(prompt_token_ids),
                [CompletionOutput(0, "", [], finish_reason="error")],
                finished=True,
                error=error,
            )

        return run()


def test_a_lost_lease_is_503_naming_the_cause(make_server: ServerFactory) -> None:
    """Not a 500: the instance is fine, the prompt's KV is gone (a decode that died
    pulled it, or its lease ran out); the proxy may prefill the request again."""
    srv = make_server(_LostLease())
    body = _body("/v1/completions", None)
    ids = prompt_ids_of(srv.url, body)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for stream in (False, True):
            rid = f"lost-{stream}"
            kv = signed(DECODE_KV, rid, ids)
            r = c.post(
                "/v1/completions",
                json={**body, "stream": stream, "kv_transfer_params": kv},
                headers={"X-Request-Id": rid},
            )
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "ServiceUnavailableError"
            assert "no longer holds the KV" in err["message"]
