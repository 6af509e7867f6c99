"""The topology file of ``pdserve launch``: schema, validation, and the process plan.

A topology is read once (``Topology.load``), validated completely (every error names
the field, e.g. ``instances[1].port``; unknown keys are refused; the field readers are
:mod:`pdserve.serving.launch.fields`), and then turned into a *plan*: one
``ProcessSpec`` per OS process (instances expanded by ``replicas``, then the proxy).
The plan holds the exact argv and the environment overrides, so ``--dry-run`` prints
what the launcher would run, byte for byte (all but the P/D secret, which the launcher
adds to every child's environment and never prints). ``docs/LAUNCH.md`` is the
user's guide to this format.

Schema (YAML)::

    model: PATH                 # default model of every instance
    served_model_name: NAME     # optional; --served-model-name of every instance
    log_dir: DIR                # optional; default a new temp dir per launch
    env: {KEY: VALUE}           # optional; for every process
    common_args: [FLAG, ...]    # optional; extra `pdserve serve` flags, every instance
    startup_timeout: 600        # seconds to answer GET /health with 200 (per process)
    grace_period: 30            # seconds between SIGTERM and SIGKILL on stop
    on_failure: restart         # restart | stop | keep: what a child's death at run time does
    restart:                    # optional; the limits of on_failure: restart
      max_restarts: 5           #   restarts of one process allowed within `window`...
      window: 600               #   ...seconds; one more death is a failure (as `stop`)
      backoff: 1                #   seconds before the first restart, doubling each time
      max_backoff: 30           #   the longest wait before a restart
    kv_transfer:                # required when a prefill or decode instance exists
      connector: PdConnector
      extra_config: {transport: tcp}
    proxy:                      # optional; fronts prefill + decode, or only colocated ones
      host: 127.0.0.1
      port: 8000
      startup_timeout: 60
      args: [FLAG, ...]         # extra `pdserve proxy` flags, e.g. ["--api-key", "K"]
    placement: {backend: local} # optional; or {backend: ray, address: auto}: see .placement
    instances:
      - role: prefill           # prefill | decode | colocated
        host: 127.0.0.1         # bind address (default 127.0.0.1; not under Ray)
        port: 8100
        devices: "0,1"          # "cpu" or GPU ids ("0", "0,1,2,3", "0-3")
        replicas: 1             # N copies on consecutive ports
        args: [FLAG, ...]       # after common_args, so they win
        model: PATH             # overrides the top-level model
        env: {KEY: VALUE}       # on top of the top-level env
        startup_timeout: 900    # overrides the top-level value
        placement: {num_cpus: 1, resources: {node_a: 1}}   # Ray only: the bundle

Argument values may be strings or numbers; a mapping is passed as its JSON text (handy
for ``--speculative-config``). With ``replicas: N`` and GPU devices, the ids are split
evenly into N consecutive groups, one per replica.

``on_failure`` decides what happens when a process (an instance or the proxy) dies
after the topology came up (a death during start-up always fails the launch):

* ``restart`` (the default): the launcher kills what is left of the dead process's
  group, waits ``backoff`` seconds (doubling after each restart of that process, at
  most ``max_backoff``), and starts it again with the same command, port and log
  (appended). The proxy's health probes route to a restarted instance again once it
  answers ``/health``. A process that would need more than ``max_restarts`` restarts
  within ``window`` seconds (or that does not come up within its
  ``startup_timeout`` after a restart, which counts as a death) is a failure: then
  the launcher does what ``stop`` does.
* ``stop``: the launcher stops every other process and exits 1.
* ``keep``: the others keep running (the proxy routes around a dead instance); the
  launcher exits 1 once none is left.
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

from pdserve.serving.launch import fields as f
from pdserve.serving.launch.fields import TopologyError
from pdserve.serving.launch.placement import (
    Bundle,
    InstancePlacement,
    NodeAssignment,
    PlacementSpec,
    check_ray_address,
    check_ray_fields,
    parse_instance_placement,
    parse_placement,
)

__all__ = ["Topology", "TopologyError", "ProcessSpec", "RestartPolicy"]

ROLES = ("prefill", "decode", "colocated")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ON_FAILURE = ("restart", "stop", "keep")
DEFAULT_ON_FAILURE = "restart"
DEFAULT_STARTUP_TIMEOUT = 600.0
DEFAULT_GRACE_PERIOD = 30.0
SERVE_CMD: tuple[str, ...] = (sys.executable, "-m", "pdserve", "serve")
PROXY_CMD: tuple[str, ...] = (sys.executable, "-m", "pdserve", "proxy")
# Under Ray an instance runs on its node with the Python of the Ray worker there
# ("{python}" is replaced on the node), bound to the node's IP ("{node_ip}" until placed)
NODE_PYTHON = "{python}"
NODE_IP = "{node_ip}"
RAY_SERVE_CMD: tuple[str, ...] = (NODE_PYTHON, "-m", "pdserve", "serve")

_TOP_KEYS = (
    "model",
    "served_model_name",
    "log_dir",
    "env",
    "common_args",
    "startup_timeout",
    "grace_period",
    "on_failure",
    "restart",
    "kv_transfer",
    "proxy",
    "instances",
    "placement",
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
    "placement",
)
_PROXY_KEYS = ("host", "port", "startup_timeout", "args")
_KV_KEYS = ("connector", "extra_config")
_RESTART_KEYS = ("max_restarts", "window", "backoff", "max_backoff")


def _instance_flags(served_name: bool) -> tuple[str, ...]:
    """Flags of ``pdserve serve`` a topology may not set in ``args``/``common_args``."""
    return f.INSTANCE_FLAGS + (("--served-model-name",) if served_name else ())


# -- the schema ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVTransferSpec:
    """``kv_transfer``: turned into ``--kv-transfer-config`` for prefill and decode."""

    connector: str
    extra_config: dict[str, Any] = field(default_factory=dict)

    def config_json(self, role: str, host: str | None = None) -> str:
        """``host``: the KV server's bind (and advertised) address, when the launcher
        picks it (under Ray: the instance's node IP)."""
        extra = self.extra_config if host is None else {**self.extra_config, "host": host}
        return json.dumps(
            {
                "kv_connector": self.connector,
                "kv_role": KV_ROLES[role],
                "kv_connector_extra_config": extra,
            }
        )


@dataclass(frozen=True)
class ProxySpec:
    host: str
    port: int
    startup_timeout: float | None = None
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartPolicy:
    """``restart``: how ``on_failure: restart`` restarts a process, and when it gives up."""

    max_restarts: int = 5
    window: float = 600.0
    backoff: float = 1.0
    max_backoff: float = 30.0

    def delay(self, recent: int) -> float:
        """Seconds to wait before a restart that follows ``recent`` restarts of the same
        process within the window."""
        return float(min(self.backoff * 2**recent, self.max_backoff))


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
    placement: InstancePlacement = field(default_factory=InstancePlacement)
    ranks: int = 1  # --tensor-parallel-size x --data-parallel-size: one GPU each
    data_parallel_size: int = 1  # its engine cores; DP rank r serves KV on port + r

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
    bundle: Bundle | None = None  # under Ray: what its placement group reserves

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
    on_failure: str = DEFAULT_ON_FAILURE
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    kv_transfer: KVTransferSpec | None = None
    proxy: ProxySpec | None = None
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    warnings: tuple[str, ...] = ()
    source: str = "<topology>"

    @classmethod
    def load(cls, path: str | Path, *, ray_address: str | None = None) -> Topology:
        """``ray_address`` (``pdserve launch --ray-address``) places the topology on that
        Ray cluster, whatever its own ``placement`` says."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise TopologyError(f"{p}: cannot read the topology file: {e.strerror}") from e
        try:
            data = f.load_yaml(text)
        except TopologyError as e:
            raise TopologyError(f"{p}: {e}") from e
        except yaml.YAMLError as e:
            raise TopologyError(f"{p}: not valid YAML: {e}") from e
        try:
            return cls.from_dict(data, source=str(p), ray_address=ray_address)
        except TopologyError as e:
            raise TopologyError(f"{p}: {e}") from e

    @classmethod
    def from_dict(
        cls, data: Any, source: str = "<topology>", *, ray_address: str | None = None
    ) -> Topology:
        if data is None:
            raise TopologyError("the topology is empty; `instances` is required")
        d = f.mapping(data, "(top level)", _TOP_KEYS)
        if ray_address is not None:
            address = check_ray_address(ray_address, "--ray-address")
            placement = d.get("placement")
            if placement is not None and not isinstance(placement, dict):
                f.mapping(placement, "placement", ())  # the error names the field
            d = {**d, "placement": {**(placement or {}), "backend": "ray", "address": address}}
        served = f.text(d, "served_model_name", "", None)
        raw_instances = f.get(d, "instances", "", f.REQUIRED)
        if not isinstance(raw_instances, list) or not raw_instances:
            raise TopologyError("instances: expected a non-empty list of instances")
        top = cls(
            instances=(),
            model=f.text(d, "model", "", None),
            served_model_name=served,
            log_dir=f.text(d, "log_dir", "", None),
            env=f.env_vars(d, "env", ""),
            common_args=f.flags(d, "common_args", "", _instance_flags(served is not None)),
            startup_timeout=f.seconds(d, "startup_timeout", "", DEFAULT_STARTUP_TIMEOUT),
            grace_period=f.seconds(d, "grace_period", "", DEFAULT_GRACE_PERIOD),
            on_failure=f.text(d, "on_failure", "", DEFAULT_ON_FAILURE),
            restart=_restart(d.get("restart")),
            kv_transfer=_kv_transfer(d.get("kv_transfer")),
            proxy=_proxy(d.get("proxy")),
            placement=parse_placement(d.get("placement")),
            source=source,
        )
        if top.on_failure not in ON_FAILURE:
            raise TopologyError(
                f"on_failure: expected restart, stop or keep, got {top.on_failure!r}"
            )
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
        serve_cmd: Sequence[str] | None = None,
        proxy_cmd: Sequence[str] = PROXY_CMD,
        nodes: Mapping[str, NodeAssignment] | None = None,
    ) -> list[ProcessSpec]:
        """Every process to start, instances first (in file order), the proxy last.

        Under Ray, ``nodes`` says where each instance process was placed (its node IP
        and Ray's GPU ids there); without it the plan shows ``{node_ip}`` placeholders.
        ``serve_cmd`` defaults to ``python -m pdserve serve`` (under Ray: the node's).
        """
        if serve_cmd is None:
            serve_cmd = RAY_SERVE_CMD if self.placement.ray else SERVE_CMD
        specs: list[ProcessSpec] = []
        counters = dict.fromkeys(ROLES, 0)
        for inst in self.instances:
            for r in range(inst.replicas):
                name = f"{inst.role}-{counters[inst.role]}"
                counters[inst.role] += 1
                node = (nodes or {}).get(name)
                specs.append(self._instance_process(inst, r, name, log_dir, serve_cmd, node))
        if self.proxy is not None:
            urls = {role: [s.url for s in specs if s.role == role] for role in ROLES}
            if urls["prefill"]:  # P/D; colocated instances beside them are not behind it
                pools = ["--prefill", *urls["prefill"], "--decode", *urls["decode"]]
            else:  # only colocated instances: the proxy load-balances them
                pools = ["--colocated", *urls["colocated"]]
            cmd = (
                *proxy_cmd,
                *pools,
                "--host",
                self.proxy.host,
                "--port",
                str(self.proxy.port),
                *self.proxy.args,
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
        self,
        inst: InstanceSpec,
        r: int,
        name: str,
        log_dir: Path,
        serve_cmd: Sequence[str],
        node: NodeAssignment | None,
    ) -> ProcessSpec:
        devices = inst.replica_devices(r)
        port = inst.port + r
        host, label = inst.host, devices_label(devices)
        visible = label if devices is not None else ""
        bundle = None
        if self.placement.ray:
            n_gpus = len(devices or ())
            bundle = Bundle(inst.placement.num_cpus, n_gpus, dict(inst.placement.resources))
            host = node.ip if node is not None else NODE_IP
            if n_gpus:  # which GPUs is Ray's choice: the ids in `devices` only count
                visible = ",".join(node.gpus) if node is not None else "{ray_gpu_ids}"
                label = visible if node is not None else f"{n_gpus} GPU(s) from Ray"
        cmd = [*serve_cmd, inst.model or self.model or "", "--host", host, "--port", str(port)]
        cmd += ["--device", "cpu" if devices is None else "cuda"]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        cmd += [*self.common_args, *inst.args]
        if inst.role in KV_ROLES:
            assert self.kv_transfer is not None  # checked in from_dict
            # under Ray a prefill KV server binds its node IP: decode on another node dials it
            kv_host = host if self.placement.ray and inst.role == "prefill" else None
            cmd += ["--kv-transfer-config", self.kv_transfer.config_json(inst.role, kv_host)]
        env = {**self.env, **inst.env, "PYTHONUNBUFFERED": "1"}
        env["CUDA_VISIBLE_DEVICES"] = visible
        return ProcessSpec(
            name=name,
            role=inst.role,
            host=host,
            port=port,
            devices=label,
            cmd=tuple(cmd),
            env=env,
            startup_timeout=inst.startup_timeout or self.startup_timeout,
            log_file=log_dir / f"{name}.log",
            bundle=bundle,
        )


def _kv_transfer(raw: Any) -> KVTransferSpec | None:
    if raw is None:
        return None
    d = f.mapping(raw, "kv_transfer", _KV_KEYS)
    extra = f.get(d, "extra_config", "kv_transfer", {})
    if not isinstance(extra, dict):
        raise TopologyError("kv_transfer.extra_config: expected a mapping")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TopologyError(f"kv_transfer.extra_config: cannot be written as JSON: {e}") from e
    return KVTransferSpec(f.text(d, "connector", "kv_transfer"), extra)


def _proxy(raw: Any) -> ProxySpec | None:
    if raw is None:
        return None
    d = f.mapping(raw, "proxy", _PROXY_KEYS)
    return ProxySpec(
        host=f.text(d, "host", "proxy", "127.0.0.1"),
        port=f.integer(d, "port", "proxy", 1, 65535, f.REQUIRED),
        startup_timeout=f.seconds(d, "startup_timeout", "proxy", None),
        args=f.flags(d, "args", "proxy", f.PROXY_FLAGS),
    )


def _restart(raw: Any) -> RestartPolicy:
    if raw is None:
        return RestartPolicy()
    d = f.mapping(raw, "restart", _RESTART_KEYS)
    default = RestartPolicy()
    policy = RestartPolicy(
        max_restarts=f.integer(d, "max_restarts", "restart", 0, 1000, default.max_restarts),
        window=f.seconds(d, "window", "restart", default.window),
        backoff=f.seconds(d, "backoff", "restart", default.backoff),
        max_backoff=f.seconds(d, "max_backoff", "restart", default.max_backoff),
    )
    if policy.max_backoff < policy.backoff:
        raise TopologyError(
            f"restart.max_backoff: {policy.max_backoff:g}s is shorter than "
            f"restart.backoff ({policy.backoff:g}s)"
        )
    return policy


def _instance(raw: Any, path: str, top: Topology) -> InstanceSpec:
    d = f.mapping(raw, path, _INSTANCE_KEYS)
    role = f.text(d, "role", path)
    if role not in ROLES:
        raise TopologyError(f"{path}.role: expected one of {', '.join(ROLES)}, got {role!r}")
    replicas = f.integer(d, "replicas", path, 1, 1024, 1)
    port = f.integer(d, "port", path, 1, 65535, f.REQUIRED)
    if port + replicas - 1 > 65535:
        raise TopologyError(f"{path}.port: {replicas} replicas from port {port} pass 65535")
    devices = f.devices(f.get(d, "devices", path, f.REQUIRED), f"{path}.devices")
    if devices is not None and len(devices) % replicas:
        raise TopologyError(
            f"{path}.devices: {len(devices)} GPU id(s) cannot be split evenly over "
            f"replicas: {replicas} (each replica gets len(devices) / replicas GPUs)"
        )
    if top.placement.ray:
        check_ray_fields(d, path)
    args = f.flags(d, "args", path, _instance_flags(top.served_model_name is not None))
    tp, dp = f.parallel_sizes((*top.common_args, *args), f"{path}.args")
    ranks = tp * dp
    if devices is not None and len(devices) // replicas < ranks:
        raise TopologyError(
            f"{path}.devices: each replica gets {len(devices) // replicas} GPU(s) but runs "
            f"{ranks} rank(s) (--tensor-parallel-size x --data-parallel-size, one GPU each)"
        )
    model = f.text(d, "model", path, None)
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
        host=NODE_IP if top.placement.ray else f.text(d, "host", path, "127.0.0.1"),
        port=port,
        devices=devices,
        replicas=replicas,
        args=args,
        model=model,
        env=f.env_vars(d, "env", path),
        startup_timeout=f.seconds(d, "startup_timeout", path, None),
        placement=parse_instance_placement(d.get("placement"), path, top.placement),
        ranks=ranks,
        data_parallel_size=dp,
    )


def _check_whole(top: Topology, instances: tuple[InstanceSpec, ...]) -> tuple[str, ...]:
    """Cross-field checks: distinct ports, a proxy with both P/D pools or colocated
    instances only; GPU sharing warns."""
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
    if top.placement.ray and top.kv_transfer and "host" in top.kv_transfer.extra_config:
        raise TopologyError(
            "kv_transfer.extra_config.host: under placement.backend: ray each prefill "
            "instance's KV server binds (and advertises to decode) its node's IP; leave "
            "`host` out"
        )
    # only prefill instances (kv_producer) bind a KV server; decode ones only dial out
    n_servers = sum(x.replicas for x in instances if x.role == "prefill")
    if kv_port is not None and n_servers > 1:
        raise TopologyError(
            f"kv_transfer.extra_config.port: all {n_servers} prefill processes would bind "
            f"KV port {kv_port}; leave it out (each instance then picks a free port)"
        )
    if isinstance(kv_port, int) and n_servers == 1:  # DP rank r serves on kv_port + r
        dp = next(x.data_parallel_size for x in instances if x.role == "prefill")
        for r in range(dp):
            claim(kv_port + r, "the KV server", "kv_transfer.extra_config.port")
    n = {role: sum(x.replicas for x in instances if x.role == role) for role in ROLES}
    if top.proxy is not None and (n["prefill"] or n["decode"]):  # else: colocated only
        for role in KV_ROLES:
            if n[role] == 0:
                raise TopologyError(
                    f"proxy: needs at least one {role} instance (found {n['prefill']} "
                    f"prefill, {n['decode']} decode), or only colocated instances (the "
                    "proxy then load-balances them)"
                )
    if top.placement.ray:  # Ray picks the GPUs: `devices` only counts them (no sharing)
        transport = top.kv_transfer.extra_config.get("transport") if top.kv_transfer else None
        if transport == "cuda_ipc":
            return (
                "kv_transfer.extra_config.transport: cuda_ipc works only between instances "
                "on one node; under Ray pin them together with placement.resources",
            )
        return ()
    return tuple(
        f"GPU {g} is shared by {', '.join(users)}"
        for g, users in sorted(gpu_users.items())
        if len(users) > 1
    )
