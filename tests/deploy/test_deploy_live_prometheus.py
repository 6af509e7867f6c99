"""A real Prometheus (from deploy/prometheus/prometheus.example.yml, targets replaced)
scrapes a launched 1P1D topology with n-gram speculation under a little load; every
query of the dashboard and every recording rule must then return data, every rule must
evaluate without error, and no alert but the SLA ones (CPU speed) may fire."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.conftest import free_ports
from e2e.test_pd_topology import _complete, _topology
from pdserve.serving.launch.launcher import Launcher
from pdserve.serving.launch.topology import Topology

from ._prom import (
    EXAMPLE_CONFIG,
    RULES,
    binary,
    dashboard,
    dashboard_exprs,
    find_binary,
    missing_reason,
    rules,
    substitute,
    used_metric_names,
)

# skip before the session's checkpoint fixtures are built
pytestmark = pytest.mark.skipif(
    find_binary("prometheus") is None, reason=missing_reason("prometheus")
)

POOLS = "prefill|decode"
# Series names that legitimately have no series on this topology -> the reason; queries
# reading them are skipped (and the test fails once they do have series, so that the
# list stays honest). None today: every series the files read exists on a healthy
# 1P1D CPU topology with n-gram speculation (graph steps show as a 0 share, not as
# a missing series).
EXPECTED_EMPTY: dict[str, str] = {}
# Series with no pool label at all (the proxy's per-prefill-instance counters).
NO_POOL_LABEL = {"pdserve:proxy_kv_released_total", "pdserve:proxy_prefill_missing_kv_params_total"}
NUM_REQUESTS = 20


def _config(path: Path, targets: dict[str, str]) -> None:
    """The example config with 1 s scrapes and rule evaluation, these targets (by job)
    and the rules file by absolute path."""
    cfg = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    cfg["rule_files"] = [str(RULES)]
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [targets[job["job_name"]]]
    assert set(targets) == {j["job_name"] for j in cfg["scrape_configs"]}
    path.write_text(yaml.safe_dump(cfg))


@contextlib.contextmanager
def _prometheus(cfg: Path, tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A Prometheus server on 127.0.0.1 with this config: (URL, process, log path)."""
    port, *_ = free_ports(1)
    log = tmp / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _wait(
    cond: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; log: {log.read_text()[-2000:]}")


def _scraped_after_load(prom: str, requests: int = NUM_REQUESTS) -> bool:
    return bool(
        len(_query(prom, 'up{job=~"pdserve.*"} == 1')) == 3
        and _query(prom, f"pdserve:proxy_time_to_first_token_seconds_count >= {requests}")
        and _query(prom, 'pdserve:proxy_spec_decode_num_drafts_total{pool="decode"} > 0')
        and _query(prom, "pool:pdserve_spec_decode_acceptance_rate:rate15m >= 0")
    )


async def _load(proxy: str) -> list[int]:
    """Streaming completions with repetitive prompts (so n-gram drafts get accepted)."""
    sem = asyncio.Semaphore(8)
    async with httpx.AsyncClient(timeout=60) as c:

        async def one(i: int) -> int:
            async with sem:
                prompt = [5, 6, 7, 8, 9, i + 10] * 6
                return (await _complete(c, proxy, prompt, stream=True, max_tokens=12))[0]

        return list(await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))))


def test_dashboard_and_rules_return_data_from_a_live_topology(
    tiny_llama: Path, tmp_path: Path
) -> None:
    topo, ports = _topology(tiny_llama, prefill=1, colocated=False)
    topo["common_args"] += ["--speculative-config", '{"method":"ngram","num_speculative_tokens":2}']
    topo["proxy"]["args"] = ["--spec-scrape-interval", "0.5", "--health-interval", "0.5"]
    cfg = tmp_path / "prometheus.yml"
    _config(
        cfg,
        {
            "pdserve-proxy": f"127.0.0.1:{ports['proxy']}",
            "pdserve-prefill": f"127.0.0.1:{ports['prefill']}",
            "pdserve-decode": f"127.0.0.1:{ports['decode']}",
        },
    )
    with (
        open(os.devnull, "w") as quiet,
        Launcher(Topology.from_dict(topo), log_dir=tmp_path / "logs", out=quiet),
        # started once the topology is up, so no target is ever seen down
        _prometheus(cfg, tmp_path) as (prom, proc, log),
    ):
        _wait(
            lambda: httpx.get(f"{prom}/-/ready", timeout=2).status_code == 200,
            30,
            "prometheus ready",
            proc,
            log,
        )
        # a first scrape of every target before the load, so the counters' rates see
        # the increase (a counter first seen after the load is flat: rate 0, ratio NaN)
        _wait(
            lambda: len(_query(prom, 'up{job=~"pdserve.*"} == 1')) == 3,
            30,
            "first scrapes",
            proc,
            log,
        )
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        # two loads with scrapes between them: a labelled series (forward steps by path)
        # exists only from its first increment, and one first scraped after a load that
        # fit between two scrapes is flat (rate 0, a ratio of rates 0 / 0); the second
        # load moves every series the first created
        for n in (1, 2):
            assert asyncio.run(_load(proxy)) == [200] * NUM_REQUESTS
            # every target up, and scraped (the proxy's spec counters included) after it
            _wait(lambda n=n: _scraped_after_load(prom, n * NUM_REQUESTS), 20,
                  f"scrapes after load {n}", proc, log)  # fmt: skip
        _check_everything(prom)


def _check_everything(prom: str) -> None:
    # every series name the rules and dashboard read exists, with its pool label (only
    # the proxy's own series may lack one: the proxy is in no pool); one query for all
    seen: dict[str, list[dict[str, str]]] = {}
    for s in _query(prom, 'group by (__name__, pool, job) ({__name__=~"pdserve:.+"})'):
        seen.setdefault(s["metric"]["__name__"], []).append(s["metric"])
    for name in sorted(used_metric_names()):
        labels = seen.get(name, [])
        if name in EXPECTED_EMPTY:
            assert not labels, f"{name} has series now: take it off EXPECTED_EMPTY"
            continue
        assert labels, f"no series {name}"
        assert all("pool" in m or m["job"] == "pdserve-proxy" for m in labels), (name, labels)
        if name not in NO_POOL_LABEL:
            assert any("pool" in m for m in labels), (name, labels)

    # a 5-minute rate window: a slow machine (CI's two cores, the soak test beside) may
    # reach these queries over a minute after the load's last step, where a 1-minute
    # window holds no increase and a ratio of two rates is 0 / 0
    queries = [
        (what, substitute(expr, pool=POOLS, sla_pool="pdserve", rate="5m"))
        for what, expr in dashboard_exprs(dashboard())
        if not any(name in expr for name in EXPECTED_EMPTY)
    ]
    for rule in rules():
        if "record" in rule:
            queries += [(rule["record"], rule["expr"]), (rule["record"], rule["record"])]
    # a series first seen in the load's last second has one sample, and a rate of it no
    # data, until the next scrape (1 s): ask again for a few scrapes before judging
    deadline = time.monotonic() + 10
    with ThreadPoolExecutor(8) as pool:
        while True:
            results = list(pool.map(lambda q: _query(prom, q[1]), queries))
            if all(results) or time.monotonic() > deadline:
                break
            time.sleep(1)
    empty = [
        f"{what}: {expr}" for (what, expr), res in zip(queries, results, strict=True) if not res
    ]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    not_finite = [
        f"{what}: {expr} -> {res}"
        for (what, expr), res in zip(queries, results, strict=True)
        if not any(math.isfinite(float(s["value"][1])) for s in res)
    ]
    assert not not_finite, "queries without a finite value:\n" + "\n".join(not_finite)

    groups = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    assert len(loaded) == len(rules())
    bad = [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    assert not bad, bad
    # nothing is down or failing (the SLA alerts are left out: a CPU decodes far slower
    # than 20 ms a token, and they only need `for: 2m` to fire)
    firing = _query(prom, 'ALERTS{alertstate="firing", alertname!~"PdserveSLA.*"}')
    assert not firing, firing
