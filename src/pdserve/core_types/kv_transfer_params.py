"""``kv_transfer_params``: the per-request P/D fields, typed and validated once at the edge.

Field names are vLLM's. The proxy sends ``{"do_remote_decode": true}`` with the prefill
leg; the prefill instance answers with where decode can pull the prompt's KV
(``do_remote_prefill`` and the ``remote_*`` fields); the proxy copies that answer into
the decode leg. ``remote_num_tokens``, ``remote_lease_seconds`` and
``remote_prompt_digest`` are pdserve's additions (the prompt length prefill computed, the
lease it holds the blocks under, and the digest of the prompt's token ids,
:func:`pdserve.core_types.pd_auth.prompt_digest`: decode refuses params for another
prompt, and prefill serves the KV only to a read for the same prompt).

:meth:`KVTransferParams.parse` turns a client's JSON object into an instance or raises
``ValueError`` naming the offending field; every later hop carries the typed struct.
"""

from __future__ import annotations

from typing import Any

import msgspec

# what decode needs to pull (present whenever ``do_remote_prefill`` is true)
REMOTE_FIELDS = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port")


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    remote_num_tokens: int | None = None
    remote_lease_seconds: float | None = None
    remote_prompt_digest: str | None = None

    @classmethod
    def parse(cls, obj: Any) -> KVTransferParams:
        """Validate a JSON object (a client's ``kv_transfer_params``); the error names the field."""
        if isinstance(obj, KVTransferParams):
            obj.check()
            return obj
        if not isinstance(obj, dict):
            raise ValueError("kv_transfer_params must be an object")
        try:
            params = msgspec.convert(obj, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params{_field_message(e)}") from None
        params.check()
        return params

    def check(self) -> None:
        """Cross-field rules; raises ValueError naming the field."""
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError(
                "kv_transfer_params.do_remote_decode and do_remote_prefill cannot both be true"
            )
        if self.do_remote_prefill:
            for name in REMOTE_FIELDS:
                if getattr(self, name) is None:
                    raise ValueError(
                        f"kv_transfer_params.{name} is required when do_remote_prefill is true"
                    )
        if self.remote_port is not None and not 0 < self.remote_port < 65536:
            raise ValueError(
                f"kv_transfer_params.remote_port must be in 1..65535, got {self.remote_port}"
            )
        if self.remote_block_ids is not None and any(b < 0 for b in self.remote_block_ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be non-negative")
        if self.tp_size != 1:
            raise ValueError(f"kv_transfer_params.tp_size must be 1, got {self.tp_size}")
        if self.remote_num_tokens is not None and self.remote_num_tokens < 1:
            raise ValueError("kv_transfer_params.remote_num_tokens must be positive")
        digest = self.remote_prompt_digest
        if digest is not None and not (0 < len(digest) <= 64 and digest.isalnum()):
            raise ValueError("kv_transfer_params.remote_prompt_digest must be 1-64 hex characters")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object a response carries (fields at their defaults are left out)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def _field_message(e: msgspec.ValidationError) -> str:
    """msgspec says ``Expected `int`, got `str` - at `$.remote_port```: name the field first."""
    msg = str(e)
    head, sep, path = msg.rpartition(" - at `$")
    if sep:
        return f"{path.rstrip('`')}: {head}"
    if msg.startswith("Object contains unknown field"):
        return ": unknown field " + msg.removeprefix("Object contains unknown field ")
    return ": " + msg
