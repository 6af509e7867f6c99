"""The deploy/ files without a server: the rules pass ``promtool check`` and their unit
tests (each alert firing and quiet on synthetic series), the dashboard's PromQL parses,
and every series name they read is one pdserve really exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from pdserve.core_types.stats import SchedulerStats
from pdserve.metrics.prometheus import PrometheusMetrics
from pdserve.serving.proxy.metrics import ProxyMetrics
from pdserve.serving.proxy.spec_stats import SpecStats

from ._prom import (
    DASHBOARD,
    EXAMPLE_CONFIG,
    RULES,
    RULES_TESTS,
    binary,
    dashboard,
    dashboard_exprs,
    panels,
    rules,
    substitute,
    used_metric_names,
)

SLA_TTFT_S = 2.5
SLA_TPOT_S = 0.020


def _promtool(*args: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _exported_names() -> set[str]:
    """Series names in the text exposition of an API server and a proxy, with every
    labelled family populated."""
    stats = SchedulerStats(
        spec_num_accepted_tokens_per_pos=[3, 1],
        step_paths={"graph": 5, "eager:graphs_off": 2},
        kv_side_channel_rejected={"malformed": 1},
        process_rss_bytes={"engine_core": 1 << 20},
    )
    api = PrometheusMetrics("m", stats_provider=lambda: stats, max_model_len=64)
    proxy = ProxyMetrics(["http://p:1"], ["http://d:1"])
    proxy.registry.register(SpecStats({"prefill": ["http://p:1"], "decode": ["http://d:1"]}))
    text = api.render()[0].decode() + proxy.render()[0].decode()
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_every_series_read_is_exported() -> None:
    exported = _exported_names()
    missing = sorted(used_metric_names() - exported)
    assert not missing, f"rules/dashboard read series pdserve does not export: {missing}"


def test_recorded_series_used_by_the_dashboard_are_defined() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    used = set()
    for _, expr in dashboard_exprs(dashboard()):
        used.update(re.findall(r"\b[a-z_]+:pdserve_[a-z0-9_]+:[a-z0-9_]+", expr))
    assert used, "the dashboard shows no recorded series"
    assert used <= recorded, sorted(used - recorded)


def test_sla_thresholds_in_rules_and_dashboard() -> None:
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    assert alerts["PdserveSLATTFTBreach"]["expr"].strip().endswith(f"> {SLA_TTFT_S}")
    assert alerts["PdserveSLATPOTBreach"]["expr"].strip().endswith(f"> {SLA_TPOT_S:.3f}")
    lines = {
        p["title"]: [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
        for p in panels(dashboard())
        if "fieldConfig" in p
    }
    assert lines["TTFT at the proxy (SLA: mean <= 2.5 s)"] == [None, SLA_TTFT_S]
    assert lines["TPOT at the proxy (SLA: mean <= 20 ms)"] == [None, SLA_TPOT_S]


def test_dashboard_shape() -> None:
    dash = dashboard()
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"DS_PROMETHEUS", "pool", "sla_pool"} <= names
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
    # no left-over template variables besides the ones the dashboard defines
    for title, expr in dashboard_exprs(dash):
        assert "$" not in substitute(expr), title


def test_promtool_check_rules_and_config() -> None:
    assert "SUCCESS" in _promtool("check", "rules", str(RULES))
    _promtool("check", "config", str(EXAMPLE_CONFIG))


def test_promtool_unit_tests_of_every_alert() -> None:
    alerts = {r["alert"] for r in rules() if "alert" in r}
    tested = yaml.safe_load(RULES_TESTS.read_text())
    covered: dict[str, set[bool]] = {}
    for case in tested["tests"]:
        for t in case.get("alert_rule_test", []):
            covered.setdefault(t["alertname"], set()).add(bool(t.get("exp_alerts")))
    # every alert is shown firing and quiet
    assert {a for a, seen in covered.items() if seen == {True, False}} == alerts, covered
    out = _promtool("test", "rules", RULES_TESTS.name, cwd=RULES_TESTS.parent)
    assert "SUCCESS" in out


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """Each dashboard query (template variables filled in) as a recording rule, so that
    promtool parses it."""
    exprs = dashboard_exprs(dashboard())
    group = {
        "name": "dashboard",
        "rules": [
            {"record": f"pdserve_dashboard_check_{i}", "expr": substitute(e)}
            for i, (_, e) in enumerate(exprs)
        ],
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    assert f"SUCCESS: {len(exprs)} rules found" in _promtool("check", "rules", str(path))
    assert DASHBOARD.is_file()
