"""``placement: {backend: ray}`` without a cluster: validation, the plan, --dry-run,
--ray-address, and the message when ``ray`` is not installed (no process started)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.serving.launch import cli
from pdserve.serving.launch.launcher import Launcher, LaunchError
from pdserve.serving.launch.placement import NodeAssignment
from pdserve.serving.launch.topology import Topology, TopologyError

from .conftest import free_ports


def base(placement: Any = None, **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model": "ckpt/tiny",
        "kv_transfer": {"connector": "PdConnector", "extra_config": {"transport": "tcp"}},
        "proxy": {"host": "127.0.0.1", "port": 18000},
        "instances": [
            {"role": "prefill", "port": 18100, "devices": "0-1", "replicas": 2},
            {"role": "decode", "port": 18200, "devices": "cpu"},
        ],
    }
    if placement is not None:
        d["placement"] = placement
    d.update(over)
    return d


def err(data: Any, **kw: Any) -> str:
    with pytest.raises(TopologyError) as e:
        Topology.from_dict(data, **kw)
    return str(e.value)


def flag(cmd: tuple[str, ...], name: str) -> str:
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


def test_local_is_the_default_and_refuses_ray_only_fields() -> None:
    t = Topology.from_dict(base())
    assert not t.placement.ray and all(s.bundle is None for s in t.plan(Path("/l")))
    assert Topology.from_dict(base({"backend": "local"})).placement == t.placement
    assert "placement.address: only with placement.backend: ray" in err(base({"address": "auto"}))
    assert "placement.placement_timeout: only with placement.backend: ray" in err(
        base({"backend": "local", "placement_timeout": 5})
    )
    d = base()
    d["instances"][1]["placement"] = {"resources": {"node_b": 1}}
    assert "instances[1].placement: only with placement.backend: ray" in err(d)


@pytest.mark.parametrize(
    ("placement", "needle"),
    [
        ({"backend": "slurm"}, "placement.backend: expected local or ray, got 'slurm'"),
        ({"backend": "ray", "zone": "x"}, "placement: unknown key(s) zone"),
        ({"backend": "ray", "address": "local"}, "would start a new Ray cluster"),
        ({"backend": "ray", "address": "ray://head:10001"}, "Ray Client"),
        ({"backend": "ray", "address": "head"}, 'expected "auto" or the head\'s'),
        ({"backend": "ray", "address": "head:0"}, 'expected "auto" or the head\'s'),
        ({"backend": "ray", "address": 6379}, 'expected "auto" or the head\'s'),
        ({"backend": "ray", "placement_timeout": 0}, "placement.placement_timeout"),
        ("ray", "placement: expected a mapping, got str"),
    ],
)
def test_bad_placement(placement: Any, needle: str) -> None:
    assert needle in err(base(placement))


@pytest.mark.parametrize(
    ("inst", "needle"),
    [
        ({"host": "0.0.0.0"}, "instances[1].host: under placement.backend: ray"),
        ({"placement": {"gpus": 1}}, "instances[1].placement: unknown key(s) gpus"),
        ({"placement": {"num_cpus": 0}}, "instances[1].placement.num_cpus: expected a number > 0"),
        ({"placement": {"resources": {"GPU": 1}}}, "resources.GPU: use the instance's `devices`"),
        ({"placement": {"resources": {"CPU": 1}}}, "resources.CPU: use num_cpus"),
        ({"placement": {"resources": {"node_b": -1}}}, "resources.node_b: expected a number > 0"),
        ({"placement": {"resources": ["node_b"]}}, "resources: expected a mapping"),
    ],
)
def test_bad_instance_fields_under_ray(inst: dict[str, Any], needle: str) -> None:
    d = base({"backend": "ray"})
    d["instances"][1].update(inst)
    assert needle in err(d)


def test_the_kv_host_is_the_launchers_under_ray() -> None:
    d = base({"backend": "ray"})
    d["kv_transfer"]["extra_config"]["host"] = "0.0.0.0"
    assert "kv_transfer.extra_config.host: under placement.backend: ray" in err(d)


def test_plan_under_ray_binds_node_ips_and_counts_gpus() -> None:
    d = base({"backend": "ray", "address": "10.0.0.1:6379", "placement_timeout": 30})
    d["instances"][1]["placement"] = {"num_cpus": 2, "resources": {"node_b": 0.5}}
    t = Topology.from_dict(d)
    assert (t.placement.address, t.placement.placement_timeout) == ("10.0.0.1:6379", 30.0)
    assert t.warnings == ()  # ids do not matter under Ray: no "GPU shared" warnings
    shown = {s.name: s for s in t.plan(Path("/l"))}  # not placed yet: placeholders
    p0 = shown["prefill-0"]
    assert p0.bundle is not None and p0.bundle.as_ray() == {"CPU": 1.0, "GPU": 1.0}
    assert (p0.url, p0.devices, p0.env["CUDA_VISIBLE_DEVICES"]) == (
        "http://{node_ip}:18100",
        "1 GPU(s) from Ray",
        "{ray_gpu_ids}",
    )
    assert p0.cmd[0] == "{python}" and flag(p0.cmd, "--host") == "{node_ip}"
    d0 = shown["decode-0"]
    assert d0.bundle is not None and d0.bundle.as_ray() == {"CPU": 2.0, "node_b": 0.5}
    nodes = {
        "prefill-0": NodeAssignment("10.0.0.7", ("3",), "n7"),
        "prefill-1": NodeAssignment("10.0.0.8", ("0",), "n8"),
        "decode-0": NodeAssignment("10.0.0.9", (), "n9"),
    }
    placed = {s.name: s for s in t.plan(Path("/l"), nodes=nodes)}
    p0, p1, d0 = placed["prefill-0"], placed["prefill-1"], placed["decode-0"]
    assert (p0.url, p0.devices, p0.env["CUDA_VISIBLE_DEVICES"]) == (
        "http://10.0.0.7:18100",
        "3",
        "3",
    )
    assert flag(p1.cmd, "--host") == "10.0.0.8" and flag(p1.cmd, "--port") == "18101"
    kv = json.loads(flag(p0.cmd, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"] == {"transport": "tcp", "host": "10.0.0.7"}
    kv = json.loads(flag(d0.cmd, "--kv-transfer-config"))  # decode runs no KV server
    assert kv["kv_connector_extra_config"] == {"transport": "tcp"}
    assert (d0.url, d0.devices, d0.env["CUDA_VISIBLE_DEVICES"]) == (
        "http://10.0.0.9:18200",
        "cpu",
        "",
    )
    proxy = placed["proxy"]
    assert proxy.bundle is None and proxy.cmd[0] == sys.executable  # the proxy runs here
    assert flag(proxy.cmd, "--decode") == "http://10.0.0.9:18200"
    i = proxy.cmd.index("--prefill")
    assert proxy.cmd[i + 1 : i + 3] == ("http://10.0.0.7:18100", "http://10.0.0.8:18101")


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def run_main(*argv: str) -> int:
    p = argparse.ArgumentParser()
    cli.add_cli_args(p)
    return cli.main(p.parse_args(list(argv)))


def test_ray_address_flag_places_a_local_file_on_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, base())
    assert run_main(str(path), "--dry-run", "--ray-address", "10.0.0.1:6379") == 0
    out = capsys.readouterr().out
    assert "# placement: ray, cluster at 10.0.0.1:6379" in out
    assert "bundle={'CPU': 1.0, 'GPU': 1.0}" in out and "--host '{node_ip}'" in out
    assert "PDSERVE_PD_SECRET=" not in out
    t = Topology.load(path, ray_address="auto")
    assert t.placement.ray and t.placement.address == "auto"
    assert run_main(str(path), "--dry-run", "--ray-address", "ray://x:1") == 2
    assert "--ray-address: 'ray://x:1': Ray Client" in capsys.readouterr().err
    d = base()
    d["instances"][0]["host"] = "127.0.0.1"  # fine locally, refused once placed on Ray
    assert run_main(str(write(tmp_path, d)), "--dry-run", "--ray-address", "auto") == 2
    assert "instances[0].host: under placement.backend: ray" in capsys.readouterr().err


def test_without_ray_installed_a_ray_topology_fails_at_start_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    d = base({"backend": "ray"}, log_dir=str(tmp_path / "logs"))
    launcher = Launcher(Topology.from_dict(d))
    with pytest.raises(LaunchError, match=r"pip install 'pdserve\[ray\]'"):
        launcher.start()
    launcher.stop()
    assert not (tmp_path / "logs").exists()  # refused before anything was made
    assert run_main(str(write(tmp_path, d))) == 1
    msg = capsys.readouterr().err
    assert "pdserve launch: error: placement.backend: ray needs the `ray` package" in msg
    assert "pip install 'pdserve[ray]'" in msg
    # the dry run needs no ray: it only prints
    assert run_main(str(write(tmp_path, d)), "--dry-run") == 0


def test_no_cluster_at_the_address_fails_at_once_and_starts_none(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="needs ray (scripts/setup-venv test installs it)")
    (port,) = free_ports(1)  # nothing listens there
    d = base({"backend": "ray", "address": f"127.0.0.1:{port}"}, log_dir=str(tmp_path / "l"))
    launcher = Launcher(Topology.from_dict(d))
    with pytest.raises(LaunchError, match="nothing answers there") as e:
        launcher.start()
    launcher.stop()
    assert "never starts a cluster" in str(e.value) and launcher.children == []


def test_cuda_ipc_under_ray_warns_that_it_needs_one_node() -> None:
    d = base({"backend": "ray"})
    d["kv_transfer"]["extra_config"]["transport"] = "cuda_ipc"
    (w,) = Topology.from_dict(d).warnings
    assert "cuda_ipc works only between instances on one node" in w
