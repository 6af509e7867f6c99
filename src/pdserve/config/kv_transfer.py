"""``--kv-transfer-config``: a P/D instance's connector, role and the connector's extras."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.config.json_arg import parse_json_arg

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
CONNECTORS = ("PdConnector",)
TRANSPORTS = ("tcp", "cuda_ipc", "nixl")

# The nixl transport's UCX worker threads: a READ's descriptors split over them took a 16K
# llama-8b-shape transfer from 1.7-2.1x to 1.4-1.5x the copy bound on one H100, 64K from
# 1.5-1.7x to 1.2x (RESULTS.md runs 111 and 115: 2, 4 and 8 threads within noise of each
# other; one worker runs its GETs one after another on one CUDA stream).
DEFAULT_NIXL_THREADS = 4


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config`` as in vLLM: connector, role and connector-specific extras.

    Extras understood by ``PdConnector`` (``kv_connector_extra_config``):
    ``transport`` (tcp | cuda_ipc | nixl; nixl needs the optional ``nixl-cu13`` or
    ``nixl-cu12`` package), ``host`` and ``port`` of this instance's KV server
    (default 127.0.0.1 and an ephemeral port), ``advertise_host`` (the address put in
    ``kv_transfer_params`` for decode to dial; default: ``host``, or for a wildcard
    ``host`` such as 0.0.0.0 the address of this machine's default route), ``lease_seconds`` (initial lease on
    prefill-held blocks, default 30), ``handshake_timeout`` (s, default 5),
    ``transfer_timeout`` (s, default 60), ``nixl_threads`` (nixl: worker threads of the
    agent's UCX backend, NIXL's ``num_threads``, a READ's descriptors split among them;
    default ``DEFAULT_NIXL_THREADS``, 0 for NIXL's single worker).

    Bounds on the KV side channel (every message on it is authenticated with the
    topology's secret, ``PDSERVE_PD_SECRET``; these bound what an authenticated peer
    may do):

    - ``max_reads_per_lease`` (prefill, default 1): reads of one held request's KV (all
      by the decode that read it first, for the same prompt); later reads are refused.
      A decode reads a lease once; more only for a transport of one's own that retries.
    - ``max_reads_per_second`` (prefill, default 1000): reads per second from one decode
      connection (a token bucket with a burst of the same size); excess reads are refused.
    - ``max_ids_per_message`` (both, default 1024): request ids in one heartbeat or done
      notice; prefill refuses a larger one, decode splits its notices to fit (give both
      roles the same value).
    - ``allowed_prefill`` (decode, default: any): a list of ``"host:port"`` KV server
      endpoints this instance may pull from; a request naming another endpoint fails
      without it being dialled (hosts compare as written: use the form prefill
      advertises as ``remote_host``).
    - ``max_prefill_peers`` (decode, default 64): prefill endpoints with a connection
      (and a worker thread) at once; a load for one more fails at once. Idle peers are
      closed after a minute.
    """

    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            hint = ""
            if self.kv_connector == "NixlConnector":  # vLLM's: the same transfer here
                hint = (
                    '; for NIXL transfers use "kv_connector": "PdConnector" with '
                    '"kv_connector_extra_config": {"transport": "nixl"}'
                )
            raise ValueError(
                f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not supported "
                f"(supported: {', '.join(CONNECTORS)}){hint}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                "--kv-transfer-config: kv_load_failure_policy must be fail or recompute"
            )
        extra = self.kv_connector_extra_config
        known = {
            "transport",
            "host",
            "advertise_host",
            "port",
            "lease_seconds",
            "handshake_timeout",
            "transfer_timeout",
            "max_reads_per_lease",
            "max_reads_per_second",
            "max_ids_per_message",
            "allowed_prefill",
            "max_prefill_peers",
            "nixl_threads",
        }
        unknown = set(extra) - known
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unknown kv_connector_extra_config key(s) "
                f"{', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"--kv-transfer-config: transport must be one of {', '.join(TRANSPORTS)}"
            )
        if self.lease_seconds <= 0:
            raise ValueError("--kv-transfer-config: lease_seconds must be > 0")
        for key in (
            "max_reads_per_lease",
            "max_reads_per_second",
            "max_ids_per_message",
            "max_prefill_peers",
        ):
            v = extra.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 1:
                raise ValueError(f"--kv-transfer-config: {key} must be a number >= 1 (got {v!r})")
        _ = self.allowed_prefill  # validates the list
        if self.nixl_threads and self.transport != "nixl":  # (the property validates it)
            raise ValueError("--kv-transfer-config: nixl_threads applies to transport nixl only")

    @classmethod
    def from_json(cls, value: str | dict | None) -> KVTransferConfig | None:
        if value is None:
            return None
        obj = parse_json_arg(value, "--kv-transfer-config")
        known = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_load_failure_policy"}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unknown key(s) {', '.join(sorted(unknown))} "
                f"(known: {', '.join(sorted(known))})"
            )
        for req in ("kv_connector", "kv_role"):
            if req not in obj:
                raise ValueError(f"--kv-transfer-config needs {req!r}")
        obj.setdefault("kv_connector_extra_config", {})
        return cls(**obj)

    @property
    def nixl_threads(self) -> int:
        default = DEFAULT_NIXL_THREADS if self.transport == "nixl" else 0
        v = self.kv_connector_extra_config.get("nixl_threads", default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(
                f"--kv-transfer-config: nixl_threads must be an integer >= 0 (got {v!r})"
            )
        return v

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transport(self) -> str:
        return str(self.kv_connector_extra_config.get("transport", "tcp"))

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_seconds", 30.0))

    @property
    def max_reads_per_lease(self) -> int:
        return int(self.kv_connector_extra_config.get("max_reads_per_lease", 1))

    @property
    def max_reads_per_second(self) -> float:
        return float(self.kv_connector_extra_config.get("max_reads_per_second", 1000.0))

    @property
    def max_ids_per_message(self) -> int:
        return int(self.kv_connector_extra_config.get("max_ids_per_message", 1024))

    @property
    def max_prefill_peers(self) -> int:
        return int(self.kv_connector_extra_config.get("max_prefill_peers", 64))

    @property
    def allowed_prefill(self) -> frozenset[tuple[str, int]] | None:
        """The ``allowed_prefill`` endpoints as (host, port), or None (any endpoint)."""
        value = self.kv_connector_extra_config.get("allowed_prefill")
        if value is None:
            return None
        bad = '--kv-transfer-config: allowed_prefill must be a list of "host:port" strings'
        if not isinstance(value, list | tuple):
            raise ValueError(f"{bad} (got {value!r})")
        out = set()
        for item in value:
            host, sep, port = str(item).rpartition(":") if isinstance(item, str) else ("", "", "")
            host = host.removeprefix("[").removesuffix("]")  # [::1]:5000
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{bad} (got {item!r})")
            out.add((host, int(port)))
        return frozenset(out)
