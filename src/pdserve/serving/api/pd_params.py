"""``kv_transfer_params`` are accepted only from this topology's proxy.

They make an instance act on a client's say-so: a decode instance dials the
``remote_host:remote_port`` they name, a prefill instance holds a prompt's KV for a
decode that may never come. So an instance takes them only when the proxy signed them
with the topology's secret (:mod:`pdserve.core_types.pd_auth`, ``PDSERVE_PD_SECRET``),
checked here, at the HTTP edge, before the prompt is tokenized and before anything
reaches the engine:

* no secret configured → 403 for any ``kv_transfer_params`` (the message says why);
* unsigned, forged, malformed signature, or expired → 403 with the reason;
* signed, but a field is malformed → 400 naming the field (the signature is checked
  before the fields are parsed).

``POST /v1/kv_transfer/release`` frees the KV held for a request id, so it is signed the
same way (:func:`verify_release`): otherwise anyone who learned a request id could drop
another client's KV before its decode read it.
"""

from __future__ import annotations

from typing import Any

from pdserve.core_types.kv_transfer_params import KVTransferParams
from pdserve.core_types.pd_auth import SECRET_ENV, SignatureError, verify_kv_params
from pdserve.serving.api.errors import APIError
from pdserve.serving.api.protocol import RequestError

PARAM = "kv_transfer_params"
FORBIDDEN = 403


def _verify(
    raw: dict[str, Any], secret: bytes | None, what: str, param: str | None = PARAM
) -> dict[str, Any]:
    if secret is None:
        raise APIError(
            FORBIDDEN,
            f"{what} are refused: this instance was started without the P/D "
            f"secret ({SECRET_ENV}), so it accepts them from nobody",
            param=param,
        )
    try:
        return verify_kv_params(raw, secret)
    except SignatureError as e:
        raise APIError(FORBIDDEN, str(e).replace(PARAM, what), param=param) from None
    except (TypeError, ValueError) as e:  # not canonical JSON (NaN, ...): nobody signed it
        raise APIError(FORBIDDEN, f"{what} cannot be verified: {e}", param=param) from None


def verify_release(raw: dict[str, Any], secret: bytes | None) -> None:
    """A KV release body is taken only when this topology's proxy signed it; else 403."""
    _verify(raw, secret, "KV releases", param=None)


def verified_kv_params(raw: dict[str, Any] | None, secret: bytes | None) -> KVTransferParams | None:
    """The typed params of a request, if this topology's proxy signed them; else
    :class:`APIError` 403, or :class:`RequestError` (400) for a malformed field."""
    if raw is None:
        return None
    fields = _verify(raw, secret, "kv_transfer_params")
    try:
        return KVTransferParams.parse(fields)
    except ValueError as e:
        raise RequestError(str(e), PARAM) from None
