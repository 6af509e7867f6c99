"""The per-topology secret signs kv_transfer_params and side-channel messages."""

from __future__ import annotations

import json

import pytest

from pdserve.core_types import pd_auth

SECRET = pd_auth.new_secret().encode()


def test_signed_params_verify_and_lose_their_signature_fields() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_port": 9}
    signed = pd_auth.sign_kv_params(params, SECRET, ttl=60, now=1000.0)
    wire = json.loads(json.dumps(signed))  # as it arrives over HTTP
    assert pd_auth.verify_kv_params(wire, SECRET, now=1010.0) == params


@pytest.mark.parametrize(
    "tamper,why",
    [
        (lambda p: p.pop("pd_signature"), "unsigned"),
        (lambda p: p.update(remote_port=10), "did not make"),
        (lambda p: p.update(remote_host="10.0.0.1"), "did not make"),
        (lambda p: p.update(pd_expires=p["pd_expires"] + 100), "did not make"),
        (lambda p: p.update(pd_signature="zz"), "malformed"),
    ],
)
def test_tampered_params_are_refused(tamper, why: str) -> None:  # type: ignore[no-untyped-def]
    signed = pd_auth.sign_kv_params({"do_remote_decode": True}, SECRET, now=1000.0)
    tamper(signed)
    with pytest.raises(pd_auth.SignatureError, match=why):
        pd_auth.verify_kv_params(signed, SECRET, now=1001.0)


def test_expired_and_foreign_signatures_are_refused() -> None:
    signed = pd_auth.sign_kv_params({"do_remote_decode": True}, SECRET, ttl=5, now=1000.0)
    with pytest.raises(pd_auth.SignatureError, match="expired"):
        pd_auth.verify_kv_params(signed, SECRET, now=1006.0)
    other = pd_auth.new_secret().encode()
    with pytest.raises(pd_auth.SignatureError, match="did not make"):
        pd_auth.verify_kv_params(signed, other, now=1001.0)


def test_secret_from_the_environment() -> None:
    assert pd_auth.load_secret({}) is None
    s = pd_auth.new_secret()
    assert pd_auth.load_secret({pd_auth.SECRET_ENV: s}) == s.encode()
    with pytest.raises(ValueError, match="at least"):
        pd_auth.load_secret({pd_auth.SECRET_ENV: "short"})


def test_mac_binds_part_boundaries() -> None:
    assert pd_auth.mac(SECRET, b"ab", b"c") != pd_auth.mac(SECRET, b"a", b"bc")
    tag = pd_auth.mac(SECRET, b"x")
    assert pd_auth.mac_ok(SECRET, tag, b"x") and not pd_auth.mac_ok(SECRET, tag, b"y")


def test_params_are_bound_to_their_request_and_used_once() -> None:
    signed = pd_auth.sign_kv_params({"do_remote_decode": True}, SECRET, now=1000.0, request_id="r1")
    again = pd_auth.sign_kv_params({"do_remote_decode": True}, SECRET, now=1000.0, request_id="r1")
    assert signed[pd_auth.NONCE_FIELD] != again[pd_auth.NONCE_FIELD]  # a fresh nonce each
    nonces = pd_auth.NonceCache()
    fields = pd_auth.verify_kv_params(signed, SECRET, 1001.0, request_id="r1", nonces=nonces)
    assert fields == {"do_remote_decode": True}
    with pytest.raises(pd_auth.SignatureError, match="already used"):
        pd_auth.verify_kv_params(signed, SECRET, 1002.0, request_id="r1", nonces=nonces)
    with pytest.raises(pd_auth.SignatureError, match="issued for request 'r1'"):
        pd_auth.verify_kv_params(again, SECRET, 1001.0, request_id="r2", nonces=nonces)
    for tamper in ({pd_auth.REQUEST_ID_FIELD: "r2"}, {pd_auth.NONCE_FIELD: "0" * 32}):
        with pytest.raises(pd_auth.SignatureError, match="did not make"):
            pd_auth.verify_kv_params({**again, **tamper}, SECRET, 1001.0)
    no_nonce = {k: v for k, v in again.items() if k != pd_auth.NONCE_FIELD}
    with pytest.raises(pd_auth.SignatureError, match="did not make"):
        pd_auth.verify_kv_params(no_nonce, SECRET, 1001.0, nonces=nonces)


def test_nonce_cache_forgets_expired_nonces_and_stays_bounded() -> None:
    cache = pd_auth.NonceCache(max_entries=3)
    assert cache.use("a", 10.0, 0.0) and not cache.use("a", 10.0, 1.0)
    assert cache.use("b", 11.0, 1.0) and cache.use("c", 12.0, 2.0)
    assert cache.use("d", 13.0, 3.0) and len(cache) == 3  # the oldest went
    assert cache.use("e", 30.0, 12.5) and len(cache) == 2  # a, b, c expired: d, e left
    assert not cache.use("d", 13.0, 12.6)


def test_prompt_digest_tells_prompts_apart() -> None:
    d = pd_auth.prompt_digest([1, 2, 3])
    assert d == pd_auth.prompt_digest((1, 2, 3)) and len(d) == 32
    assert d != pd_auth.prompt_digest([1, 2, 4]) and d != pd_auth.prompt_digest([1, 2, 3, 0])
    assert pd_auth.prompt_digest([2**40]) != pd_auth.prompt_digest([0])
