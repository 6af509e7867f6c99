"""Where a topology's instances run: the ``placement`` fields of a topology file.

By default (``placement`` left out, or ``backend: local``) every process is a child of
the launcher on this machine. With ``backend: ray`` the launcher connects to an existing
Ray cluster (it never starts one) and places each instance process (each replica) in a
placement group of its own; :mod:`pdserve.serving.launch.ray_placement` does the work.
The proxy stays on the launcher's machine either way.

Schema (YAML)::

    placement:                  # optional; default backend: local
      backend: ray              # local | ray
      address: auto             # ray only: "auto" (the cluster this machine belongs to,
                                # or RAY_ADDRESS) or the head's GCS "host:port"
      placement_timeout: 120    # ray only: seconds for every placement group to be ready
    instances:
      - role: prefill
        placement:              # optional; ray only: one bundle per instance process
          num_cpus: 1           #   CPUs reserved for it (default 1)
          resources: {node_a: 1}   # custom Ray resources, e.g. to pin it to a node

Under Ray the bundle of an instance process is ``{CPU: num_cpus, GPU: len(devices)
/ replicas, **resources}``, placed ``STRICT_PACK`` (one node); which GPUs it gets is
Ray's choice, so ``devices`` counts GPUs there. Each instance binds its node's IP (the
one Ray reports), so an instance's ``host`` and ``kv_transfer.extra_config.host`` are
the launcher's to set and are refused in the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.serving.launch import fields as f
from pdserve.serving.launch.fields import TopologyError

__all__ = [
    "Bundle",
    "InstancePlacement",
    "NodeAssignment",
    "PlacementSpec",
    "check_ray_address",
]

BACKENDS = ("local", "ray")
DEFAULT_PLACEMENT_TIMEOUT = 120.0
_KEYS = ("backend", "address", "placement_timeout")
_RAY_ONLY = ("address", "placement_timeout")
_INSTANCE_KEYS = ("num_cpus", "resources")
# resources a bundle gets from other fields; a user value would fight them
_BUILTIN_RESOURCES = {
    "CPU": "use num_cpus",
    "GPU": "use the instance's `devices` (its GPU count)",
    "memory": "memory is not reserved by the launcher",
    "object_store_memory": "the instances do not use Ray's object store",
}


@dataclass(frozen=True)
class PlacementSpec:
    """The top-level ``placement``: local processes, or Ray placement groups."""

    backend: str = "local"
    address: str = "auto"  # ray only
    placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT  # ray only

    @property
    def ray(self) -> bool:
        return self.backend == "ray"


@dataclass(frozen=True)
class InstancePlacement:
    """An instance's ``placement`` (Ray only): its bundle beyond the GPUs."""

    num_cpus: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Bundle:
    """What one instance process's placement group reserves (one bundle, one node)."""

    num_cpus: float
    num_gpus: int
    resources: dict[str, float] = field(default_factory=dict)

    def as_ray(self) -> dict[str, float]:
        """The bundle as Ray spells it."""
        out = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            out["GPU"] = float(self.num_gpus)
        return out


@dataclass(frozen=True)
class NodeAssignment:
    """Where Ray placed an instance process: its node's IP and the GPU ids it got there."""

    ip: str
    gpus: tuple[str, ...] = ()
    node_id: str = ""


def check_ray_address(value: Any, path: str) -> str:
    """``auto`` or the head's ``host:port``; never ``local`` (that starts a cluster) nor
    a Ray Client address (the launcher must run on a node of the cluster)."""
    if not isinstance(value, str) or not value.strip():
        raise TopologyError(f'{path}: expected "auto" or the head\'s "host:port", got {value!r}')
    v = value.strip()
    if v == "local":
        raise TopologyError(
            f"{path}: 'local' would start a new Ray cluster; pdserve launch only connects "
            'to a running one (start it with `ray start --head`, then give "auto" or the '
            'head\'s "host:port")'
        )
    if "://" in v:
        raise TopologyError(
            f"{path}: {v!r}: Ray Client and other URL addresses are not supported; run "
            'pdserve launch on a node of the cluster and give "auto" or the head\'s '
            '"host:port"'
        )
    if v == "auto":
        return v
    host, sep, port = v.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TopologyError(f'{path}: expected "auto" or the head\'s "host:port", got {v!r}')
    return v


def parse_placement(raw: Any) -> PlacementSpec:
    if raw is None:
        return PlacementSpec()
    d = f.mapping(raw, "placement", _KEYS)
    backend = f.text(d, "backend", "placement", "local")
    if backend not in BACKENDS:
        raise TopologyError(f"placement.backend: expected local or ray, got {backend!r}")
    if backend == "local":
        given = [k for k in _RAY_ONLY if d.get(k) is not None]
        if given:
            raise TopologyError(
                f"placement.{given[0]}: only with placement.backend: ray (local processes "
                "need no cluster)"
            )
        return PlacementSpec()
    address = d.get("address")
    return PlacementSpec(
        backend="ray",
        address="auto" if address is None else check_ray_address(address, "placement.address"),
        placement_timeout=f.seconds(d, "placement_timeout", "placement", DEFAULT_PLACEMENT_TIMEOUT),
    )


def _amount(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (v > 0 and math.isfinite(v)):
        raise TopologyError(f"{path}: expected a number > 0, got {v!r}")
    return float(v)


def parse_instance_placement(raw: Any, path: str, top: PlacementSpec) -> InstancePlacement:
    """``instances[i].placement``; refused unless the topology is placed on Ray."""
    p = f"{path}.placement"
    if raw is None:
        return InstancePlacement()
    if not top.ray:
        raise TopologyError(
            f"{p}: only with placement.backend: ray (local processes are not placed)"
        )
    d = f.mapping(raw, p, _INSTANCE_KEYS)
    num_cpus = _amount(d["num_cpus"], f"{p}.num_cpus") if d.get("num_cpus") is not None else 1.0
    res = f.get(d, "resources", p, {})
    if not isinstance(res, dict):
        raise TopologyError(f"{p}.resources: expected a mapping of resource name: amount")
    resources: dict[str, float] = {}
    for name, amount in res.items():
        if not isinstance(name, str) or not name.strip():
            raise TopologyError(f"{p}.resources: invalid resource name {name!r}")
        if name in _BUILTIN_RESOURCES:
            raise TopologyError(f"{p}.resources.{name}: {_BUILTIN_RESOURCES[name]}")
        resources[name] = _amount(amount, f"{p}.resources.{name}")
    return InstancePlacement(num_cpus=num_cpus, resources=resources)


def check_ray_fields(d: dict[str, Any], path: str) -> None:
    """Fields of an instance that the launcher sets itself under Ray."""
    if d.get("host") is not None:
        raise TopologyError(
            f"{path}.host: under placement.backend: ray each instance binds its node's IP "
            "(the one Ray reports), since the proxy and its peers run on other nodes; "
            "leave `host` out"
        )
