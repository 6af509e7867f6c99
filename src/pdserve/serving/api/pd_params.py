"""``kv_transfer_params`` are accepted only from this topology's proxy, for the request
they were issued for, once.

They make an instance act on a client's say-so: a decode instance dials the
``remote_host:remote_port`` they name, a prefill instance holds a prompt's KV for a
decode that may never come. So an instance takes them only when the proxy signed them
with the topology's secret (:mod:`pdserve.core_types.pd_auth`, ``PDSERVE_PD_SECRET``),
checked here, at the HTTP edge, before the prompt is tokenized and before anything
reaches the engine:

* no secret configured → 403 for any ``kv_transfer_params`` (the message says why);
* unsigned, forged, malformed signature, or expired → 403 with the reason;
* signed for another request id (the leg's ``X-Request-Id``) → 403;
* signed, but a field is malformed → 400 naming the field (the signature is checked
  before the fields are parsed).

Once the prompt is tokenized (:func:`check_prompt_binding`): a decode leg's params carry
the digest of the prompt prefill computed (``remote_prompt_digest``), and params issued
for another prompt are refused (403), so one client's KV never answers another
client's prompt; then the params' nonce is spent, and params presented again (a
replay) are refused (403). (Spent only then: a replay with another prompt cannot use up
the legitimate request's params.)

``POST /v1/kv_transfer/release`` frees the KV held for a request id, so it is signed the
same way (:func:`verify_release`): otherwise anyone who learned a request id could drop
another client's KV before its decode read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.pd_auth import (
    SECRET_ENV,
    NonceCache,
    SignatureError,
    prompt_digest,
    use_nonce,
    verify_kv_params,
)
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.protocol import RequestError

PARAM = "kv_transfer_params"
FORBIDDEN = 403


def _verify(
    raw: dict[str, Any],
    secret: bytes | None,
    what: str,
    param: str | None = PARAM,
    *,
    request_id: str | None = None,
    nonces: NonceCache | None = None,
) -> dict[str, Any]:
    if secret is None:
        raise APIError(
            FORBIDDEN,
            f"{what} are refused: this instance was started without the P/D "
            f"secret ({SECRET_ENV}), so it accepts them from nobody",
            param=param,
        )
    try:
        return verify_kv_params(raw, secret, request_id=request_id, nonces=nonces)
    except SignatureError as e:
        raise APIError(FORBIDDEN, str(e).replace(PARAM, what), param=param) from None
    except (TypeError, ValueError) as e:  # not canonical JSON (NaN, ...): nobody signed it
        raise APIError(FORBIDDEN, f"{what} cannot be verified: {e}", param=param) from None


def verify_release(
    raw: dict[str, Any], secret: bytes | None, nonces: NonceCache | None = None
) -> None:
    """A KV release body is taken only when this topology's proxy signed it (once, when
    ``nonces`` is given); else 403."""
    _verify(raw, secret, "KV releases", param=None, nonces=nonces)


def verified_kv_params(
    raw: dict[str, Any] | None, secret: bytes | None, request_id: str | None = None
) -> KVTransferParams | None:
    """The typed params of a request, if this topology's proxy signed them for
    ``request_id``; else :class:`APIError` 403, or :class:`RequestError` (400) for a
    malformed field. (Their nonce is spent by :func:`check_prompt_binding`.)"""
    if raw is None:
        return None
    fields = _verify(raw, secret, PARAM, request_id=request_id)
    try:
        return KVTransferParams.parse(fields)
    except ValueError as e:
        raise RequestError(str(e), PARAM) from None


def check_prompt_binding(
    kv: KVTransferParams | None,
    token_ids: Sequence[int],
    raw: dict[str, Any] | None,
    nonces: NonceCache,
) -> None:
    """403 unless a decode leg's params were issued for this very prompt (their
    ``remote_prompt_digest`` is the digest of ``token_ids``: the prompt as this instance
    tokenized it, after any truncation), or if the params (``raw``, as verified) were
    used before; else their nonce is spent."""
    if kv is None or raw is None:
        return
    if kv.do_remote_prefill:
        _check_digest(kv, token_ids)
    try:
        use_nonce(raw, nonces)
    except SignatureError as e:
        raise APIError(FORBIDDEN, str(e), param=PARAM) from None


def _check_digest(kv: KVTransferParams, token_ids: Sequence[int]) -> None:
    if kv.remote_prompt_digest is None:
        raise APIError(
            FORBIDDEN,
            "kv_transfer_params carry no remote_prompt_digest: they cannot be bound to "
            "this prompt, so its KV is not pulled",
            param=PARAM,
        )
    if kv.remote_prompt_digest != prompt_digest(token_ids):
        raise APIError(
            FORBIDDEN,
            "kv_transfer_params were issued for another prompt (remote_prompt_digest "
            "differs from this prompt's): the KV they name is not this prompt's",
            param=PARAM,
        )
