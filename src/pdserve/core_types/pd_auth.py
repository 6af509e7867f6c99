"""The per-topology P/D secret, and what it signs.

A topology's prefill and decode instances, its proxy and its KV side channels share one
secret (``pdserve launch`` generates one per launch and hands it to its children in the
environment; a hand-made topology sets the same value for every process). It proves
two things:

- **kv_transfer_params come from the proxy.** The proxy signs the params it puts on
  each leg (:func:`sign_kv_params`: an HMAC-SHA256 over the canonical JSON of the other
  fields plus an expiry time); an instance verifies them at its HTTP edge
  (:func:`verify_kv_params`) and refuses anything else with 403. So a client can neither
  make a prefill instance hold KV nor point a decode instance at a host of its choosing.
- **KV side-channel peers are part of the topology.** Every message on the side channel
  carries a MAC (:func:`mac`) the receiver checks before it parses the message.

The secret travels in the environment (``PDSERVE_PD_SECRET``), never on a command line
where other users of the host could read it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from typing import Any

SECRET_ENV = "PDSERVE_PD_SECRET"
SIGNATURE_FIELD = "pd_signature"
EXPIRES_FIELD = "pd_expires"
DEFAULT_TTL_S = 120.0
MIN_SECRET_CHARS = 32


class SignatureError(PermissionError):
    """kv_transfer_params that no proxy of this topology signed (or that expired)."""


def new_secret() -> str:
    """A fresh random secret (64 hex characters)."""
    return secrets.token_hex(32)


def load_secret(env: dict[str, str] | None = None) -> bytes | None:
    """The secret from ``PDSERVE_PD_SECRET``, or None when it is not set. A set but
    too-short value is a ValueError (a guessable secret protects nothing)."""
    value = (env if env is not None else os.environ).get(SECRET_ENV)
    if value is None or value == "":
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{SECRET_ENV} must be at least {MIN_SECRET_CHARS} characters "
            f"(pdserve launch generates one; or use: python -c 'import secrets; "
            f"print(secrets.token_hex(32))')"
        )
    return value.encode()


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the parts, each length-prefixed (so part boundaries count)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def mac_ok(secret: bytes, tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(secret, *parts), tag)


def _canonical(params: dict[str, Any]) -> bytes:
    body = {k: v for k, v in params.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign_kv_params(
    params: dict[str, Any], secret: bytes, ttl: float = DEFAULT_TTL_S, now: float | None = None
) -> dict[str, Any]:
    """A copy of ``params`` with an expiry ``ttl`` seconds from now and a signature over
    everything else."""
    out = {k: v for k, v in params.items() if k not in (SIGNATURE_FIELD, EXPIRES_FIELD)}
    out[EXPIRES_FIELD] = round((time.time() if now is None else now) + ttl, 3)
    out[SIGNATURE_FIELD] = mac(secret, b"kv_transfer_params", _canonical(out)).hex()
    return out


def verify_kv_params(
    params: dict[str, Any], secret: bytes, now: float | None = None
) -> dict[str, Any]:
    """The params without their signature fields, if a holder of ``secret`` signed them
    and they have not expired; else :class:`SignatureError` saying which."""
    sig = params.get(SIGNATURE_FIELD)
    expires = params.get(EXPIRES_FIELD)
    if not isinstance(sig, str) or not isinstance(expires, int | float):
        raise SignatureError(
            "kv_transfer_params are accepted only from this topology's proxy (unsigned)"
        )
    try:
        tag = bytes.fromhex(sig)
    except ValueError:
        raise SignatureError("kv_transfer_params carry a malformed signature") from None
    if not mac_ok(secret, tag, b"kv_transfer_params", _canonical(params)):
        raise SignatureError("kv_transfer_params carry a signature this topology did not make")
    if expires < (time.time() if now is None else now):
        raise SignatureError("kv_transfer_params have expired")
    return {k: v for k, v in params.items() if k not in (SIGNATURE_FIELD, EXPIRES_FIELD)}
