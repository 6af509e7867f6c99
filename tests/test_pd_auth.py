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
