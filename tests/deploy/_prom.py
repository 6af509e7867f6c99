"""Shared helpers of the deploy/ tests: where the files and the Prometheus binaries are,
and the PromQL expressions the dashboard and the rules use."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "pdserve-rules.yml"
RULES_TESTS = DEPLOY / "prometheus" / "pdserve-rules.test.yml"
EXAMPLE_CONFIG = DEPLOY / "prometheus" / "prometheus.example.yml"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"

# pdserve:<name> as it appears in PromQL (recorded series are named level:pdserve_...:op)
METRIC_NAME = re.compile(r"pdserve:[A-Za-z0-9_]+")

INSTALL_HINT = (
    "install the Debian package 'prometheus' (scripts/setup-venv test does this when run "
    "as root with apt-get), or point {env} at the binary"
)


def find_binary(name: str) -> str | None:
    """Path of ``promtool`` / ``prometheus``: env ``PDSERVE_<NAME>`` first, then PATH."""
    return os.environ.get(f"PDSERVE_{name.upper()}") or shutil.which(name)


def missing_reason(name: str) -> str:
    return f"{name} not found: " + INSTALL_HINT.format(env=f"PDSERVE_{name.upper()}")


def binary(name: str) -> str:
    """:func:`find_binary`, skipping the calling test with the reason when it is missing."""
    path = find_binary(name)
    if not path:
        pytest.skip(missing_reason(name))
    return path


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title / legend, expr)`` for every query of every panel."""
    return [
        (f"{p['title']} / {t.get('legendFormat', t['refId'])}", t["expr"])
        for p in panels(dash)
        for t in p.get("targets", [])
    ]


def substitute(expr: str, pool: str = ".*", sla_pool: str = ".*", rate: str = "1m") -> str:
    """The expression as Grafana would send it, with these template values."""
    return (
        expr.replace("$__rate_interval", rate).replace("$sla_pool", sla_pool).replace("$pool", pool)
    )


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def used_metric_names() -> set[str]:
    """Every ``pdserve:`` series name the rules and the dashboard read."""
    names = set(METRIC_NAME.findall(RULES.read_text()))
    for _, expr in dashboard_exprs(dashboard()):
        names.update(METRIC_NAME.findall(expr))
    return names
