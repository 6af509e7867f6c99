"""Reading a topology file's fields: YAML loading without duplicate keys, and readers
that check one field each and raise :class:`TopologyError` naming it (e.g.
``instances[1].port: expected an integer in [1, 65535], got 'x'``).

The schema itself, and what each field means, is :mod:`pdserve.serving.launch.topology`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from pdserve.core_types.pd_auth import SECRET_ENV

REQUIRED = object()  # a reader's default: the field must be present

# Flags the launcher sets itself on `pdserve serve`; a user value would silently lose or win.
INSTANCE_FLAGS = ("--host", "--port", "--device", "--kv-transfer-config")
# ... and on `pdserve proxy`.
PROXY_FLAGS = ("--prefill", "--decode", "--colocated", "--host", "--port")
FLAG_WHY = {
    "--host": "use the `host` field",
    "--port": "use the `port` field",
    "--device": 'use the instance\'s `devices` ("cpu" or GPU ids)',
    "--kv-transfer-config": "use the top-level `kv_transfer` (the role picks kv_role)",
    "--served-model-name": "the top-level `served_model_name` already sets it",
    "--prefill": "the launcher lists the prefill instances",
    "--decode": "the launcher lists the decode instances",
    "--colocated": "the launcher lists the colocated instances",
}
# Variables the launcher sets itself, and why.
MANAGED_ENV = {
    "CUDA_VISIBLE_DEVICES": "is set by the launcher from each instance's `devices`",
    SECRET_ENV: (
        "is set by the launcher (a new secret per launch, or the launcher's own "
        f"{SECRET_ENV}): a secret does not belong in a topology file"
    ),
}


class TopologyError(ValueError):
    """A topology that cannot be launched; the message starts with the field's path."""


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


def load_yaml(text: str) -> Any:
    """Safe YAML; a duplicate key is a :class:`TopologyError`."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass


def mapping(value: Any, path: str, allowed: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TopologyError(f"{path}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise TopologyError(
            f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return value


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def get(d: Mapping[str, Any], key: str, path: str, default: Any) -> Any:
    if key not in d or d[key] is None:
        if default is REQUIRED:
            raise TopologyError(f"{join(path, key)}: required")
        return default
    return d[key]


def text(d: Mapping[str, Any], key: str, path: str, default: Any = REQUIRED) -> Any:
    v = get(d, key, path, default)
    if v is default and default is not REQUIRED:
        return v
    if not isinstance(v, str) or not v.strip():
        raise TopologyError(f"{join(path, key)}: expected a non-empty string, got {v!r}")
    return v


def integer(d: Mapping[str, Any], key: str, path: str, lo: int, hi: int, default: Any) -> Any:
    v = get(d, key, path, default)
    if v is default and default is not REQUIRED:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise TopologyError(f"{join(path, key)}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def seconds(d: Mapping[str, Any], key: str, path: str, default: Any) -> Any:
    v = get(d, key, path, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
        raise TopologyError(f"{join(path, key)}: expected a number of seconds > 0, got {v!r}")
    return float(v)


def scalar_text(v: Any, path: str) -> str:
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


def flags(d: Mapping[str, Any], key: str, path: str, managed: Sequence[str]) -> tuple[str, ...]:
    """A list of command-line arguments; refuses the ``managed`` flags."""
    p = join(path, key)
    v = get(d, key, path, [])
    if not isinstance(v, list):
        raise TopologyError(f'{p}: expected a list of flags, e.g. ["--max-num-seqs", "64"]')
    out = tuple(scalar_text(a, f"{p}[{i}]") for i, a in enumerate(v))
    for i, a in enumerate(out):
        flag = a.split("=", 1)[0]
        if flag in managed:
            raise TopologyError(f"{p}[{i}]: {flag} is set by the launcher; {FLAG_WHY[flag]}")
    return out


def env_vars(d: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    p = join(path, key)
    v = get(d, key, path, {})
    if not isinstance(v, dict):
        raise TopologyError(f"{p}: expected a mapping of NAME: value")
    out: dict[str, str] = {}
    for k, val in v.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise TopologyError(f"{p}: invalid variable name {k!r}")
        if k in MANAGED_ENV:
            raise TopologyError(f"{p}.{k}: {MANAGED_ENV[k]}")
        out[k] = scalar_text(val, f"{p}.{k}")
    return out


def devices(v: Any, path: str) -> tuple[int, ...] | None:
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


PARALLEL_FLAGS = ("--tensor-parallel-size", "--data-parallel-size")


def parallel_sizes(args: Sequence[str], path: str) -> tuple[int, int]:
    """(``--tensor-parallel-size``, ``--data-parallel-size``) of ``pdserve serve`` flags
    (the last of each wins; 1 when absent). The instance runs their product of ranks,
    one GPU each."""
    sizes = dict.fromkeys(PARALLEL_FLAGS, 1)
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag not in sizes:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if not value.isdigit() or int(value) < 1:
            raise TopologyError(f"{path}: {flag} needs a positive integer (got {value!r})")
        sizes[flag] = int(value)
    return sizes[PARALLEL_FLAGS[0]], sizes[PARALLEL_FLAGS[1]]
