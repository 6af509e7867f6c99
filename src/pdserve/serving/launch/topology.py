"""The topology file of ``pdserve launch``: schema, validation, and the process plan.

A topology is read once (``Topology.load``), validated completely (every error names
the field, e.g. ``instances[1].port``; unknown keys are refused), and then turned into
a *plan*: one ``ProcessSpec`` per OS process (instances expanded by ``replicas``, then
the proxy). The plan holds the exact argv and the environment overrides, so
``--dry-run`` prints what the launcher would run, byte for byte.

Schema (YAML)::

    model: PATH                 # default model of every instance
    served_model_name: NAME     # optional; --served-model-name of every instance
    log_dir: DIR                # optional; default a new temp dir per launch
    env: {KEY: VALUE}           # optional; for every process
    common_args: [FLAG, ...]    # optional; extra `pdserve serve` flags, every instance
    startup_timeout: 600        # seconds to answer GET /health with 200 (per process)
    grace_period: 30            # seconds between SIGTERM and SIGKILL on stop
    on_failure: stop            # stop | keep: what a child's death at run time does
    kv_transfer:                # required when a prefill or decode instance exists
      connector: PdConnector
      extra_config: {transport: tcp}
    proxy: {host: 127.0.0.1, port: 8000, startup_timeout: 60}   # optional
    instances:
      - role: prefill           # prefill | decode | colocated
        host: 127.0.0.1         # bind address (default 127.0.0.1)
        port: 8100
        devices: "0,1"          # "cpu" or GPU ids ("0", "0,1,2,3", "0-3")
        replicas: 1             # N copies on consecutive ports
        args: [FLAG, ...]       # after common_args, so they win
        model: PATH             # overrides the top-level model
        env: {KEY: VALUE}       # on top of the top-level env
        startup_timeout: 900    # overrides the top-level value

Argument values may be strings or numbers; a mapping is passed as its JSON text (handy
for ``--speculative-config``). With ``replicas: N`` and GPU devices, the ids are split
evenly into N consecutive groups, one per replica.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLES = ("prefill", "decode", "colocated")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ON_FAILURE = ("stop", "keep")
DEFAULT_STARTUP_TIMEOUT = 600.0
DEFAULT_GRACE_PERIOD = 30.0
SERVE_CMD: tuple[str, ...] = (sys.executable, "-m", "pdserve", "serve")
PROXY_CMD: tuple[str, ...] = (sys.executable, "-m", "pdserve", "proxy")

_TOP_KEYS = (
    "model",
    "served_model_name",
    "log_dir",
    "env",
    "common_args",
    "startup_timeout",
    "grace_period",
    "on_failure",
    "kv_transfer",
    "proxy",
    "instances",
)
_INSTANCE_KEYS = (
    "role",
    "host",
    "port",
    "devices",
    "replicas",
    "args",
    "model",
    "env",
    "startup_timeout",
)
_PROXY_KEYS = ("host", "port", "startup_timeout")
_KV_KEYS = ("connector", "extra_config")
# Flags the launcher sets itself; a user value would silently lose or win.
_MANAGED_FLAGS = ("--host", "--port", "--device", "--kv-transfer-config")
_MANAGED_ENV = ("CUDA_VISIBLE_DEVICES",)
_REQUIRED = object()


class TopologyError(ValueError):
    """A topology that cannot be launched; the message starts with the field's path."""


# -- YAML loading ------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate mapping keys (PyYAML keeps the last one)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise TopologyError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


# -- field readers (each error names the field) -------------------------------------------


def _mapping(value: Any, path: str, allowed: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TopologyError(f"{path}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise TopologyError(
            f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _get(d: Mapping[str, Any], key: str, path: str, default: Any) -> Any:
    if key not in d or d[key] is None:
        if default is _REQUIRED:
            raise TopologyError(f"{_join(path, key)}: required")
        return default
    return d[key]


def _str(d: Mapping[str, Any], key: str, path: str, default: Any = _REQUIRED) -> Any:
    v = _get(d, key, path, default)
    if v is default and default is not _REQUIRED:
        return v
    if not isinstance(v, str) or not v.strip():
        raise TopologyError(f"{_join(path, key)}: expected a non-empty string, got {v!r}")
    return v


def _int(d: Mapping[str, Any], key: str, path: str, lo: int, hi: int, default: Any) -> Any:
    v = _get(d, key, path, default)
    if v is default and default is not _REQUIRED:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise TopologyError(f"{_join(path, key)}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _seconds(d: Mapping[str, Any], key: str, path: str, default: Any) -> Any:
    v = _get(d, key, path, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise TopologyError(f"{_join(path, key)}: expected a number of seconds > 0, got {v!r}")
    return float(v)


def _scalar_text(v: Any, path: str) -> str:
    if isinstance(v, bool) or v is None:
        raise TopologyError(f"{path}: expected a string or a number, got {v!r} (quote it)")
    if isinstance(v, str | int | float):
        return str(v)
    if isinstance(v, dict):
        try:
            return json.dumps(v)
        except (TypeError, ValueError) as e:
            raise TopologyError(f"{path}: cannot be written as JSON: {e}") from e
    raise TopologyError(f"{path}: expected a string, a number or a mapping, got {v!r}")


def _args(d: Mapping[str, Any], key: str, path: str, served_name: bool) -> tuple[str, ...]:
    p = _join(path, key)
    v = _get(d, key, path, [])
    if not isinstance(v, list):
        raise TopologyError(f'{p}: expected a list of flags, e.g. ["--max-num-seqs", "64"]')
    out = tuple(_scalar_text(a, f"{p}[{i}]") for i, a in enumerate(v))
    managed = _MANAGED_FLAGS + (("--served-model-name",) if served_name else ())
    for i, a in enumerate(out):
        flag = a.split("=", 1)[0]
        if flag in managed:
            raise TopologyError(f"{p}[{i}]: {flag} is set by the launcher; {_MANAGED_WHY[flag]}")
    return out


_MANAGED_WHY = {
    "--host": "use the instance's `host`",
    "--port": "use the instance's `port`",
    "--device": 'use the instance\'s `devices` ("cpu" or GPU ids)',
    "--kv-transfer-config": "use the top-level `kv_transfer` (the role picks kv_role)",
    "--served-model-name": "the top-level `served_model_name` already sets it",
}


def _env(d: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    p = _join(path, key)
    v = _get(d, key, path, {})
    if not isinstance(v, dict):
        raise TopologyError(f"{p}: expected a mapping of NAME: value")
    out: dict[str, str] = {}
    for k, val in v.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise TopologyError(f"{p}: invalid variable name {k!r}")
        if k in _MANAGED_ENV:
            raise TopologyError(f"{p}.{k}: is set by the launcher from each instance's `devices`")
        out[k] = _scalar_text(val, f"{p}.{k}")
    return out


def _devices(v: Any, path: str) -> tuple[int, ...] | None:
    """``None`` for CPU, else the GPU ids in the order given."""
    hint = 'expected "cpu" or GPU ids like "0", "0,1,2,3" or "0-3"'
    if isinstance(v, bool) or v is None:
        raise TopologyError(f"{path}: {hint} (got {v!r})")
    if isinstance(v, int):
        v = str(v)
    if not isinstance(v, str):
        raise TopologyError(f"{path}: {hint} (got {v!r})")
    if v.strip().lower() == "cpu":
        return None
    ids: list[int] = []
    try:
        for part in v.split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a:
                raise ValueError(part)
            ids.extend(range(a, b + 1))
    except ValueError:
        raise TopologyError(f"{path}: {hint} (got {v!r})") from None
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise TopologyError(f"{path}: GPU id(s) {dup} listed twice in {v!r}")
    return tuple(ids)


# -- the schema ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVTransferSpec:
    """``kv_transfer``: turned into ``--kv-transfer-config`` for prefill and decode."""

    connector: str
    extra_config: dict[str, Any] = field(default_factory=dict)

    def config_json(self, role: str) -> str:
        return json.dumps(
            {
                "kv_connector": self.connector,
                "kv_role": KV_ROLES[role],
                "kv_connector_extra_config": self.extra_config,
            }
        )


@dataclass(frozen=True)
class ProxySpec:
    host: str
    port: int
    startup_timeout: float | None = None


@dataclass(frozen=True)
class InstanceSpec:
    """One ``instances[i]`` entry (before expansion by ``replicas``)."""

    role: str
    host: str
    port: int
    devices: tuple[int, ...] | None  # None: CPU
    replicas: int = 1
    args: tuple[str, ...] = ()
    model: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float | None = None

    def replica_devices(self, i: int) -> tuple[int, ...] | None:
        if self.devices is None:
            return None
        n = len(self.devices) // self.replicas
        return self.devices[i * n : (i + 1) * n]


def devices_label(devices: tuple[int, ...] | None) -> str:
    return "cpu" if devices is None else ",".join(map(str, devices))


def connect_host(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine (URL form)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class ProcessSpec:
    """One OS process of the plan: exact argv, env overrides, and where its log goes."""

    name: str  # prefill-0 | decode-0 | colocated-0 | proxy
    role: str  # prefill | decode | colocated | proxy
    host: str
    port: int
    devices: str  # "cpu", "0,1,2,3", or "-" for the proxy
    cmd: tuple[str, ...]
    env: dict[str, str]  # set on top of the launcher's own environment
    startup_timeout: float
    log_file: Path

    @property
    def url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}"

    def shell_line(self) -> str:
        """The command as one copy-pastable shell line, env overrides first."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(["env", *env, shlex.join(self.cmd)])


@dataclass(frozen=True)
class Topology:
    """A validated topology file; immutable. Build with ``load`` or ``from_dict``."""

    instances: tuple[InstanceSpec, ...]
    model: str | None = None
    served_model_name: str | None = None
    log_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    common_args: tuple[str, ...] = ()
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    grace_period: float = DEFAULT_GRACE_PERIOD
    on_failure: str = "stop"
    kv_transfer: KVTransferSpec | None = None
    proxy: ProxySpec | None = None
    warnings: tuple[str, ...] = ()
    source: str = "<topology>"

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise TopologyError(f"{p}: cannot read the topology file: {e.strerror}") from e
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
        except TopologyError as e:
            raise TopologyError(f"{p}: {e}") from e
        except yaml.YAMLError as e:
            raise TopologyError(f"{p}: not valid YAML: {e}") from e
        try:
            return cls.from_dict(data, source=str(p))
        except TopologyError as e:
            raise TopologyError(f"{p}: {e}") from e

    @classmethod
    def from_dict(cls, data: Any, source: str = "<topology>") -> Topology:
        if data is None:
            raise TopologyError("the topology is empty; `instances` is required")
        d = _mapping(data, "(top level)", _TOP_KEYS)
        served = _str(d, "served_model_name", "", None)
        raw_instances = _get(d, "instances", "", _REQUIRED)
        if not isinstance(raw_instances, list) or not raw_instances:
            raise TopologyError("instances: expected a non-empty list of instances")
        top = cls(
            instances=(),
            model=_str(d, "model", "", None),
            served_model_name=served,
            log_dir=_str(d, "log_dir", "", None),
            env=_env(d, "env", ""),
            common_args=_args(d, "common_args", "", served is not None),
            startup_timeout=_seconds(d, "startup_timeout", "", DEFAULT_STARTUP_TIMEOUT),
            grace_period=_seconds(d, "grace_period", "", DEFAULT_GRACE_PERIOD),
            on_failure=_str(d, "on_failure", "", "stop"),
            kv_transfer=_kv_transfer(d.get("kv_transfer")),
            proxy=_proxy(d.get("proxy")),
            source=source,
        )
        if top.on_failure not in ON_FAILURE:
            raise TopologyError(f"on_failure: expected stop or keep, got {top.on_failure!r}")
        instances = tuple(
            _instance(raw, f"instances[{i}]", top) for i, raw in enumerate(raw_instances)
        )
        warnings = _check_whole(top, instances)
        return cls(**{**top.__dict__, "instances": instances, "warnings": warnings})

    # -- the plan --------------------------------------------------------------------------

    def plan(
        self,
        log_dir: Path,
        *,
        serve_cmd: Sequence[str] = SERVE_CMD,
        proxy_cmd: Sequence[str] = PROXY_CMD,
    ) -> list[ProcessSpec]:
        """Every process to start, instances first (in file order), the proxy last."""
        specs: list[ProcessSpec] = []
        counters = dict.fromkeys(ROLES, 0)
        for inst in self.instances:
            for r in range(inst.replicas):
                name = f"{inst.role}-{counters[inst.role]}"
                counters[inst.role] += 1
                specs.append(self._instance_process(inst, r, name, log_dir, serve_cmd))
        if self.proxy is not None:
            urls = {role: [s.url for s in specs if s.role == role] for role in KV_ROLES}
            cmd = (
                *proxy_cmd,
                "--prefill",
                *urls["prefill"],
                "--decode",
                *urls["decode"],
                "--host",
                self.proxy.host,
                "--port",
                str(self.proxy.port),
            )
            specs.append(
                ProcessSpec(
                    name="proxy",
                    role="proxy",
                    host=self.proxy.host,
                    port=self.proxy.port,
                    devices="-",
                    cmd=cmd,
                    env={**self.env, "PYTHONUNBUFFERED": "1"},
                    startup_timeout=self.proxy.startup_timeout or self.startup_timeout,
                    log_file=log_dir / "proxy.log",
                )
            )
        return specs

    def _instance_process(
        self, inst: InstanceSpec, r: int, name: str, log_dir: Path, serve_cmd: Sequence[str]
    ) -> ProcessSpec:
        devices = inst.replica_devices(r)
        port = inst.port + r
        cmd = [*serve_cmd, inst.model or self.model or "", "--host", inst.host, "--port", str(port)]
        cmd += ["--device", "cpu" if devices is None else "cuda"]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += [*self.common_args, *inst.args]
        if inst.role in KV_ROLES:
            assert self.kv_transfer is not None  # checked in from_dict
            cmd += ["--kv-transfer-config", self.kv_transfer.config_json(inst.role)]
        env = {**self.env, **inst.env, "PYTHONUNBUFFERED": "1"}
        env["CUDA_VISIBLE_DEVICES"] = devices_label(devices) if devices is not None else ""
        return ProcessSpec(
            name=name,
            role=inst.role,
            host=inst.host,
            port=port,
            devices=devices_label(devices),
            cmd=tuple(cmd),
            env=env,
            startup_timeout=inst.startup_timeout or self.startup_timeout,
            log_file=log_dir / f"{name}.log",
        )


def _kv_transfer(raw: Any) -> KVTransferSpec | None:
    if raw is None:
        return None
    d = _mapping(raw, "kv_transfer", _KV_KEYS)
    extra = _get(d, "extra_config", "kv_transfer", {})
    if not isinstance(extra, dict):
        raise TopologyError("kv_transfer.extra_config: expected a mapping")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TopologyError(f"kv_transfer.extra_config: cannot be written as JSON: {e}") from e
    return KVTransferSpec(_str(d, "connector", "kv_transfer"), extra)


def _proxy(raw: Any) -> ProxySpec | None:
    if raw is None:
        return None
    d = _mapping(raw, "proxy", _PROXY_KEYS)
    return ProxySpec(
        host=_str(d, "host", "proxy", "127.0.0.1"),
        port=_int(d, "port", "proxy", 1, 65535, _REQUIRED),
        startup_timeout=_seconds(d, "startup_timeout", "proxy", None),
    )


def _instance(raw: Any, path: str, top: Topology) -> InstanceSpec:
    d = _mapping(raw, path, _INSTANCE_KEYS)
    role = _str(d, "role", path)
    if role not in ROLES:
        raise TopologyError(f"{path}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    replicas = _int(d, "replicas", path, 1, 1024, 1)
    port = _int(d, "port", path, 1, 65535, _REQUIRED)
    if port + replicas - 1 > 65535:
        raise TopologyError(f"{path}.port: {replicas} replicas from port {port} pass 65535")
    devices = _devices(_get(d, "devices", path, _REQUIRED), f"{path}.devices")
    if devices is not None and len(devices) % replicas:
        raise TopologyError(
            f"{path}.devices: {len(devices)} GPU id(s) cannot be split evenly over "
            f"replicas: {replicas} (each replica gets len(devices) / replicas GPUs)"
        )
    model = _str(d, "model", path, None)
    if model is None and top.model is None:
        raise TopologyError(
            f"{path}.model: no model given; set the top-level `model` or {path}.model"
        )
    if role in KV_ROLES and top.kv_transfer is None:
        raise TopologyError(
            f"kv_transfer: required because {path} has role {role} "
            "(it becomes --kv-transfer-config with "
            f"kv_role {KV_ROLES[role]}); e.g. kv_transfer: {{connector: PdConnector}}"
        )
    return InstanceSpec(
        role=role,
        host=_str(d, "host", path, "127.0.0.1"),
        port=port,
        devices=devices,
        replicas=replicas,
        args=_args(d, "args", path, top.served_model_name is not None),
        model=model,
        env=_env(d, "env", path),
        startup_timeout=_seconds(d, "startup_timeout", path, None),
    )


def _check_whole(top: Topology, instances: tuple[InstanceSpec, ...]) -> tuple[str, ...]:
    """Cross-field checks: distinct ports, a proxy with both pools; GPU sharing warns."""
    owners: dict[int, str] = {}

    def claim(port: int, owner: str, field_path: str) -> None:
        if port in owners:
            raise TopologyError(f"{field_path}: port {port} of {owner} clashes with {owners[port]}")
        owners[port] = owner

    gpu_users: dict[int, list[str]] = {}
    for i, inst in enumerate(instances):
        for r in range(inst.replicas):
            who = f"instances[{i}]" + (f" (replica {r})" if inst.replicas > 1 else "")
            claim(inst.port + r, who, f"instances[{i}].port")
            for g in inst.replica_devices(r) or ():
                gpu_users.setdefault(g, []).append(who)
    if top.proxy is not None:
        claim(top.proxy.port, "the proxy", "proxy.port")
    kv_port = top.kv_transfer.extra_config.get("port") if top.kv_transfer else None
    n_pd = sum(x.replicas for x in instances if x.role in KV_ROLES)
    if kv_port is not None and n_pd > 1:
        raise TopologyError(
            f"kv_transfer.extra_config.port: all {n_pd} prefill/decode processes would bind "
            f"KV port {kv_port}; leave it out (each instance then picks a free port)"
        )
    if isinstance(kv_port, int) and n_pd == 1:
        claim(kv_port, "the KV server", "kv_transfer.extra_config.port")
    if top.proxy is not None:
        n = {role: sum(x.replicas for x in instances if x.role == role) for role in ROLES}
        if n["prefill"] == 0 and n["decode"] == 0:
            raise TopologyError(
                "proxy: the proxy routes requests from prefill to decode instances, but every "
                "instance is colocated; remove `proxy` (clients call colocated instances "
                "directly) or add prefill and decode instances"
            )
        for role in KV_ROLES:
            if n[role] == 0:
                raise TopologyError(
                    f"proxy: needs at least one {role} instance "
                    f"(found {n['prefill']} prefill, {n['decode']} decode)"
                )
    return tuple(
        f"GPU {g} is shared by {', '.join(users)}"
        for g, users in sorted(gpu_users.items())
        if len(users) > 1
    )
