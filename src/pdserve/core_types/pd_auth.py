"""The per-topology P/D secret, and what it signs.

A topology's prefill and decode instances, its proxy and its KV side channels share one
secret (``pdserve launch`` generates one per launch and hands it to its children in the
environment; a hand-made topology sets the same value for every process). It proves
two things:

- **kv_transfer_params come from the proxy, for one request, once.** The proxy signs
  the params it puts on each leg (:func:`sign_kv_params`: an HMAC-SHA256 over the
  canonical JSON of the other fields plus an expiry time, the request id the leg carries
  as ``X-Request-Id`` and a fresh random nonce); an instance verifies them at its HTTP
  edge (:func:`verify_kv_params`) and refuses anything else with 403: params for another
  request id, and params whose nonce it has already seen (:class:`NonceCache`: a
  captured leg cannot be replayed). So a client can neither make a prefill instance
  hold KV nor point a decode instance at a host of its choosing. The decode leg's params
  also carry the digest of the prompt's token ids prefill computed
  (:func:`prompt_digest`, ``remote_prompt_digest``): decode refuses a prompt whose
  digest differs, and prefill serves the KV only to a read that names the same digest.
- **KV side-channel peers are part of the topology.** Every message on the side channel
  carries a MAC (:func:`mac`) the receiver checks before it parses the message; the
  MAC covers a per-connection session and a counter, so a recorded message is never
  accepted twice (``pdserve.kv_transfer.wire``).

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
from collections.abc import Sequence
from typing import Any

import numpy as np

SECRET_ENV = "PDSERVE_PD_SECRET"
SIGNATURE_FIELD = "pd_signature"
EXPIRES_FIELD = "pd_expires"
NONCE_FIELD = "pd_nonce"
REQUEST_ID_FIELD = "pd_request_id"
AUTH_FIELDS = (SIGNATURE_FIELD, EXPIRES_FIELD, NONCE_FIELD, REQUEST_ID_FIELD)
DEFAULT_TTL_S = 120.0
MIN_SECRET_CHARS = 32
MAX_NONCES = 1 << 20  # remembered at once (a proxy's legs of the last DEFAULT_TTL_S)


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


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The digest of a prompt's token ids (sha256 over them as little-endian int64, 32
    hex characters): what binds a prompt's KV to the prompt."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def sign_kv_params(
    params: dict[str, Any],
    secret: bytes,
    ttl: float = DEFAULT_TTL_S,
    now: float | None = None,
    *,
    request_id: str | None = None,
) -> dict[str, Any]:
    """A copy of ``params`` with an expiry ``ttl`` seconds from now, a fresh nonce, the
    request id it is for (when given) and a signature over everything else."""
    out = {k: v for k, v in params.items() if k not in AUTH_FIELDS}
    out[EXPIRES_FIELD] = round((time.time() if now is None else now) + ttl, 3)
    out[NONCE_FIELD] = secrets.token_hex(16)
    if request_id is not None:
        out[REQUEST_ID_FIELD] = request_id
    out[SIGNATURE_FIELD] = mac(secret, b"kv_transfer_params", _canonical(out)).hex()
    return out


class NonceCache:
    """The nonces of the signed params an instance has accepted, until they expire: a
    second use of one is a replay. Bounded (:data:`MAX_NONCES`; past that the oldest are
    forgotten: only the proxy mints nonces, so only its own rate fills it). Used from one
    thread (the API server's event loop)."""

    def __init__(self, max_entries: int = MAX_NONCES) -> None:
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}  # nonce -> expiry, in insertion order

    def __len__(self) -> int:
        return len(self._seen)

    def use(self, nonce: str, expires: float, now: float) -> bool:
        """Record ``nonce``; False if it was seen before (a replay)."""
        self._forget_expired(now)
        if nonce in self._seen:
            return False
        if len(self._seen) >= self.max_entries:
            del self._seen[next(iter(self._seen))]
        self._seen[nonce] = expires
        return True

    def _forget_expired(self, now: float) -> None:
        # expiries grow with insertion (one TTL): the expired ones are at the front
        while self._seen:
            nonce, expires = next(iter(self._seen.items()))
            if expires >= now:
                return
            del self._seen[nonce]


def verify_kv_params(
    params: dict[str, Any],
    secret: bytes,
    now: float | None = None,
    *,
    request_id: str | None = None,
    nonces: NonceCache | None = None,
) -> dict[str, Any]:
    """The params without their signature fields, if a holder of ``secret`` signed them
    and they have not expired; with ``request_id``, only if they were signed for that
    request; with ``nonces``, only the first time they are presented. Else
    :class:`SignatureError` saying which."""
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
    now = time.time() if now is None else now
    if expires < now:
        raise SignatureError("kv_transfer_params have expired")
    if request_id is not None and params.get(REQUEST_ID_FIELD) != request_id:
        raise SignatureError(
            f"kv_transfer_params were issued for request {params.get(REQUEST_ID_FIELD)!r}, "
            f"not for this one ({request_id!r})"
        )
    if nonces is not None:
        use_nonce(params, nonces, now)
    return {k: v for k, v in params.items() if k not in AUTH_FIELDS}


def use_nonce(params: dict[str, Any], nonces: NonceCache, now: float | None = None) -> None:
    """Record the nonce of verified params; :class:`SignatureError` if they carry none or
    it was used before (a replay)."""
    nonce = params.get(NONCE_FIELD)
    expires = params.get(EXPIRES_FIELD)
    if not isinstance(nonce, str) or not nonce or not isinstance(expires, int | float):
        raise SignatureError("kv_transfer_params carry no nonce (single use)")
    if not nonces.use(nonce, float(expires), time.time() if now is None else now):
        raise SignatureError("kv_transfer_params were already used (a replay)")
