"""The P/D secret reaches every child through the environment only; ``proxy: args``
reach the proxy."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from pdserve.core_types.pd_auth import SECRET_ENV, new_secret
from pdserve.serving.launch import cli
from pdserve.serving.launch.launcher import LaunchError
from pdserve.serving.launch.topology import Topology, TopologyError

from .conftest import free_ports, marked_pids
from .test_restart import starts
from .test_supervision import launcher, topo


@pytest.mark.parametrize("inherited", [True, False], ids=["inherited", "generated"])
def test_secret_reaches_every_child_by_environment_only(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch, inherited: bool
) -> None:
    own = new_secret()
    if inherited:
        monkeypatch.setenv(SECRET_ENV, own)
    else:
        monkeypatch.delenv(SECRET_ENV, raising=False)
    p0, d0, c0, px = free_ports(4)
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "prefill", "port": p0, "devices": "cpu"},
            {"role": "decode", "port": d0, "devices": "cpu"},
            {"role": "colocated", "port": c0, "devices": "cpu"},
        ],
        kv_transfer={"connector": "PdConnector"},
        proxy={"port": px},
    )
    la = launcher(t)
    la.start()
    try:
        runs = [starts(tmp_path, "serve", p)[0] for p in (p0, d0, c0)]
        runs.append(starts(tmp_path, "proxy", px)[0])
        secrets = {r["env"].get(SECRET_ENV) for r in runs}
        assert len(secrets) == 1  # one secret for the whole topology
        (secret,) = secrets
        assert secret is not None and len(secret) == 64
        assert (secret == own) is inherited
        for c in la.children:  # on no command line
            cmdline = Path(f"/proc/{c.pid}/cmdline").read_bytes()
            assert secret.encode() not in cmdline and secret not in " ".join(c.spec.cmd)
            assert SECRET_ENV not in c.spec.env  # so neither in --dry-run's env prefix
        assert secret not in (tmp_path / "logs" / "launch.json").read_text()
        assert secret not in la._out.getvalue()  # type: ignore[union-attr]
    finally:
        la.stop()
    assert marked_pids(marker) == []


def test_dry_run_does_not_print_the_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = Path(__file__).resolve().parents[2] / "examples"
    p = argparse.ArgumentParser()
    cli.add_cli_args(p)
    assert cli.main(p.parse_args([str(examples / "1p1d-cpu.yaml"), "--dry-run"])) == 0
    out = capsys.readouterr().out
    assert os.environ[SECRET_ENV] not in out  # tests/conftest.py sets one for the session
    assert f"{SECRET_ENV}=" not in out
    assert f"every process also gets {SECRET_ENV} in its environment" in out


def test_a_short_inherited_secret_fails_the_launch(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "too-short")
    (a,) = free_ports(1)
    la = launcher(topo(tmp_path, marker, [{"role": "colocated", "port": a, "devices": "cpu"}]))
    with pytest.raises(LaunchError, match=f"{SECRET_ENV} must be at least 32 characters"):
        la.start()
    assert la.children == []


def test_the_secret_does_not_belong_in_the_topology() -> None:
    d = {
        "model": "m",
        "env": {SECRET_ENV: new_secret()},
        "instances": [{"role": "colocated", "port": 18100, "devices": "cpu"}],
    }
    with pytest.raises(TopologyError, match=f"env.{SECRET_ENV}: is set by the launcher"):
        Topology.from_dict(d)


def test_proxy_args_reach_the_proxy(tmp_path: Path, marker: str) -> None:
    p0, d0, px = free_ports(3)
    extra = ["--api-key", "k1", "--health-interval", 0.5, "--queue-timeout", "5"]
    t = topo(
        tmp_path,
        marker,
        [
            {"role": "prefill", "port": p0, "devices": "cpu"},
            {"role": "decode", "port": d0, "devices": "cpu"},
        ],
        kv_transfer={"connector": "PdConnector"},
        proxy={"port": px, "args": extra},
    )
    la = launcher(t)
    la.start()
    try:
        argv = starts(tmp_path, "proxy", px)[0]["argv"]
        assert argv[argv.index("--port") + 2 :] == [str(a) for a in extra]
    finally:
        la.stop()
    state = json.loads((tmp_path / "logs" / "launch.json").read_text())
    assert state["processes"][-1]["name"] == "proxy"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--port", "1"], "proxy.args[0]: --port is set by the launcher"),
        (["--x", "--decode=h:1"], "proxy.args[1]: --decode is set by the launcher"),
        ("--api-key k", "proxy.args: expected a list of flags"),
    ],
)
def test_proxy_args_refuse_managed_flags(args: object, expected: str) -> None:
    d = {
        "model": "m",
        "kv_transfer": {"connector": "PdConnector"},
        "proxy": {"port": 18000, "args": args},
        "instances": [
            {"role": "prefill", "port": 18100, "devices": "cpu"},
            {"role": "decode", "port": 18200, "devices": "cpu"},
        ],
    }
    with pytest.raises(TopologyError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        Topology.from_dict(d)
