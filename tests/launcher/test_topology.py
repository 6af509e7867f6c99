"""Schema validation and command construction of ``pdserve launch`` (no process started)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.serving.launch.topology import Topology, TopologyError


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "model": "ckpt/tiny",
        "kv_transfer": {"connector": "PdConnector", "extra_config": {"transport": "tcp"}},
        "proxy": {"host": "127.0.0.1", "port": 18000},
        "instances": [
            {"role": "prefill", "port": 18100, "devices": "cpu"},
            {"role": "decode", "port": 18200, "devices": "cpu"},
        ],
    }
    d.update(over)
    return d


def err(data: Any) -> str:
    with pytest.raises(TopologyError) as e:
        Topology.from_dict(data)
    return str(e.value)


def plan(data: dict[str, Any]) -> dict[str, Any]:
    specs = Topology.from_dict(data).plan(Path("/logs"))
    return {s.name: s for s in specs}


def flag(cmd: tuple[str, ...], name: str) -> str:
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


# -- validation -----------------------------------------------------------------------------


def test_unknown_keys_are_refused_with_their_path() -> None:
    assert "(top level): unknown key(s) modle" in err(base(modle="x"))
    d = base()
    d["instances"][1]["gpus"] = "0"
    msg = err(d)
    assert "instances[1]: unknown key(s) gpus" in msg and "devices" in msg
    assert "proxy: unknown key(s) url" in err(base(proxy={"port": 1, "url": "x"}))
    assert "kv_transfer: unknown key(s) role" in err(
        base(kv_transfer={"connector": "X", "role": "kv_producer"})
    )


def test_bad_role() -> None:
    d = base()
    d["instances"][0]["role"] = "prefil"
    assert "instances[0].role: expected one of prefill, decode, colocated, got 'prefil'" in err(d)


def test_port_clash_names_both_owners() -> None:
    d = base()
    d["instances"][1]["port"] = 18100
    msg = err(d)
    assert msg.startswith("instances[1].port: port 18100 of instances[1]") and "instances[0]" in msg
    # replicas take consecutive ports
    d = base()
    d["instances"][0]["replicas"] = 3
    d["instances"][1]["port"] = 18102
    assert "port 18102 of instances[1] clashes with instances[0] (replica 2)" in err(d)
    assert "proxy.port: port 18100 of the proxy clashes with instances[0]" in err(
        base(proxy={"port": 18100})
    )


def test_missing_model() -> None:
    d = base()
    del d["model"]
    assert "instances[0].model: no model given" in err(d)
    d["instances"][0]["model"] = "a"
    d["instances"][1]["model"] = "b"
    assert Topology.from_dict(d).instances[1].model == "b"


def test_proxy_needs_both_pd_pools_or_only_colocated_instances() -> None:
    d = base(instances=[{"role": "prefill", "port": 18100, "devices": "cpu"}])
    msg = err(d)
    assert msg.startswith("proxy: needs at least one decode instance (found 1 prefill, 0 decode)")
    assert "or only colocated instances" in msg
    d["instances"].append({"role": "colocated", "port": 18300, "devices": "cpu"})
    assert "proxy: needs at least one decode instance" in err(d)


def test_proxy_in_front_of_colocated_replicas_gets_their_urls() -> None:
    d = base(
        proxy={"port": 18000, "args": ["--health-interval", 1]},
        instances=[{"role": "colocated", "port": 18100, "devices": "0,1", "replicas": 2}],
    )
    del d["kv_transfer"]  # no prefill or decode instance needs it
    p = plan(d)
    assert list(p) == ["colocated-0", "colocated-1", "proxy"]
    assert p["proxy"].cmd == (
        sys.executable, "-m", "pdserve", "proxy",
        "--colocated", "http://127.0.0.1:18100", "http://127.0.0.1:18101",
        "--host", "127.0.0.1", "--port", "18000", "--health-interval", "1",
    )  # fmt: skip
    assert [p[f"colocated-{i}"].env["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["0", "1"]
    # beside a P/D pair, colocated instances are not behind the proxy (called directly)
    d = base()
    d["instances"].append({"role": "colocated", "port": 18300, "devices": "cpu"})
    cmd = plan(d)["proxy"].cmd
    assert "--colocated" not in cmd and "http://127.0.0.1:18300" not in cmd
    assert flag(cmd, "--decode") == "http://127.0.0.1:18200"
    # the launcher lists the instances itself
    d = base(proxy={"port": 18000, "args": ["--colocated", "h:1"]})
    assert "proxy.args[0]: --colocated is set by the launcher" in err(d)


@pytest.mark.parametrize(
    ("over", "expected"),
    [
        ({"instances": []}, "instances: expected a non-empty list"),
        ({"instances": None}, "instances: required"),
        ({"startup_timeout": 0}, "startup_timeout: expected a number of seconds > 0"),
        ({"grace_period": "x"}, "grace_period: expected a number of seconds > 0"),
        ({"on_failure": "retry"}, "on_failure: expected restart, stop or keep"),
        ({"restart": {"retries": 1}}, "restart: unknown key(s) retries; allowed: max_restarts"),
        ({"restart": {"max_restarts": -1}}, "restart.max_restarts: expected an integer in"),
        ({"restart": {"backoff": 5, "max_backoff": 1}}, "restart.max_backoff: 1s is shorter"),
        ({"proxy": {"port": 18000, "args": [None]}}, "proxy.args[0]: expected a string"),
        ({"proxy": {"host": "h"}}, "proxy.port: required"),
        ({"proxy": {"port": 70000}}, "proxy.port: expected an integer in [1, 65535]"),
        ({"env": {"A": True}}, "env.A: expected a string or a number"),
        (
            {"env": {"CUDA_VISIBLE_DEVICES": "0"}},
            "env.CUDA_VISIBLE_DEVICES: is set by the launcher",
        ),
        ({"common_args": "--dtype float32"}, "common_args: expected a list of flags"),
        ({"common_args": ["--port", "1"]}, "common_args[0]: --port is set by the launcher"),
        ({"kv_transfer": None}, "kv_transfer: required because instances[0] has role prefill"),
        ({"kv_transfer": {"extra_config": {}}}, "kv_transfer.connector: required"),
        ({"model": 3}, "model: expected a non-empty string"),
    ],
)
def test_top_level_field_errors(over: dict[str, Any], expected: str) -> None:
    assert expected in err(base(**over))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("devices", "gpu0", 'instances[0].devices: expected "cpu" or GPU ids'),
        ("devices", "0,0", "GPU id(s) [0] listed twice"),
        ("devices", "3-1", 'expected "cpu" or GPU ids'),
        ("devices", None, "instances[0].devices: required"),
        ("port", "8100", "instances[0].port: expected an integer in [1, 65535]"),
        ("port", True, "instances[0].port: expected an integer"),
        ("replicas", 0, "instances[0].replicas: expected an integer in [1, 1024]"),
        ("args", ["--kv-transfer-config={}"], "instances[0].args[0]: --kv-transfer-config is set"),
        ("args", ["--device", "cuda"], "instances[0].args[0]: --device is set by the launcher"),
        ("args", [None], "instances[0].args[0]: expected a string or a number"),
        ("host", "", "instances[0].host: expected a non-empty string"),
        ("startup_timeout", -1, "instances[0].startup_timeout: expected a number of seconds"),
    ],
)
def test_instance_field_errors(field: str, value: Any, expected: str) -> None:
    d = base()
    d["instances"][0][field] = value
    assert expected in err(d)


def test_replicas_must_split_gpus_evenly() -> None:
    d = base()
    d["instances"][0].update(devices="0,1,2", replicas=2)
    assert "instances[0].devices: 3 GPU id(s) cannot be split evenly over replicas: 2" in err(d)


def test_devices_must_cover_the_ranks() -> None:
    d = base()
    d["instances"][0].update(devices="0-3", args=["--data-parallel-size", "4"])
    assert Topology.from_dict(d).instances[0].ranks == 4
    d["instances"][0].update(devices="0-5", replicas=2)
    msg = err(d)
    assert "instances[0].devices: each replica gets 3 GPU(s) but runs 4 rank(s)" in msg
    d["instances"][0].update(devices="0,1", replicas=1, args=["--data-parallel-size=two"])
    assert "--data-parallel-size needs a positive integer (got 'two')" in err(d)


def test_fixed_kv_port_is_refused_when_shared() -> None:
    kv = {"connector": "PdConnector", "extra_config": {"port": 18300}}
    d = base(kv_transfer=kv)  # 1P1D: only the prefill binds a KV server
    plans = plan(d)
    assert '"port": 18300' in flag(plans["prefill-0"].cmd, "--kv-transfer-config")
    d["instances"][0]["replicas"] = 2
    assert "kv_transfer.extra_config.port: all 2 prefill processes would bind" in err(d)
    d = base(kv_transfer={**kv, "extra_config": {"port": 18100}}, proxy=None)
    d["instances"][1]["role"] = "colocated"
    assert "kv_transfer.extra_config.port: port 18100 of the KV server clashes with" in err(d)


def test_served_model_name_flag_clash() -> None:
    d = base(served_model_name="tiny", common_args=["--served-model-name", "x"])
    assert "common_args[0]: --served-model-name is set by the launcher" in err(d)
    del d["served_model_name"]
    Topology.from_dict(d)  # without the top-level name the flag is the user's


def test_yaml_file_errors(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text("model: a\nmodel: b\ninstances: []\n")
    with pytest.raises(TopologyError, match=r"t.yaml: duplicate key 'model' \(line 2\)"):
        Topology.load(p)
    p.write_text("instances: [\n")
    with pytest.raises(TopologyError, match="t.yaml: not valid YAML"):
        Topology.load(p)
    p.write_text("")
    with pytest.raises(TopologyError, match="the topology is empty"):
        Topology.load(p)
    p.write_text("- 1\n")
    with pytest.raises(TopologyError, match=r"\(top level\): expected a mapping, got list"):
        Topology.load(p)
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        Topology.load(tmp_path / "missing.yaml")


def test_shared_gpus_warn() -> None:
    d = base()
    d["instances"][0]["devices"] = "0,1"
    d["instances"][1]["devices"] = "1"
    assert Topology.from_dict(d).warnings == ("GPU 1 is shared by instances[0], instances[1]",)


# -- command construction --------------------------------------------------------------------


def test_prefill_and_decode_commands() -> None:
    d = base(
        served_model_name="tiny",
        env={"A": 1},
        common_args=["--dtype", "float32", "--max-num-seqs", 8],
    )
    d["instances"][0].update(args=["--max-num-seqs", "64"], env={"B": "x"})
    d["instances"][1].update(devices="2,3", model="other")
    p = plan(d)
    assert list(p) == ["prefill-0", "decode-0", "proxy"]
    pre, dec, proxy = p["prefill-0"], p["decode-0"], p["proxy"]
    assert pre.cmd[:5] == (sys.executable, "-m", "pdserve", "serve", "ckpt/tiny")
    assert dec.cmd[4] == "other"
    assert flag(pre.cmd, "--host") == "127.0.0.1" and flag(pre.cmd, "--port") == "18100"
    assert flag(pre.cmd, "--served-model-name") == "tiny"
    # common args first, instance args after them (argparse: the last one wins)
    i = pre.cmd.index("--dtype")
    assert pre.cmd[i : i + 6] == (
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--max-num-seqs",
        "64",
    )
    assert json.loads(flag(pre.cmd, "--kv-transfer-config")) == {
        "kv_connector": "PdConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"transport": "tcp"},
    }
    assert json.loads(flag(dec.cmd, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    assert flag(pre.cmd, "--device") == "cpu" and pre.env["CUDA_VISIBLE_DEVICES"] == ""
    assert flag(dec.cmd, "--device") == "cuda" and dec.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert pre.env["A"] == "1" and pre.env["B"] == "x" and "B" not in dec.env
    assert pre.log_file == Path("/logs/prefill-0.log") and proxy.log_file == Path("/logs/proxy.log")
    assert proxy.cmd == (
        sys.executable, "-m", "pdserve", "proxy",
        "--prefill", "http://127.0.0.1:18100",
        "--decode", "http://127.0.0.1:18200",
        "--host", "127.0.0.1", "--port", "18000",
    )  # fmt: skip
    assert pre.startup_timeout == 600.0


def test_colocated_gets_no_kv_transfer_and_replicas_expand() -> None:
    d = base(startup_timeout=5)
    del d["proxy"]
    d["instances"] = [
        {"role": "colocated", "port": 18300, "devices": "0-3", "replicas": 2, "startup_timeout": 9},
        {"role": "prefill", "port": 18400, "devices": "6,7", "replicas": 2, "host": "0.0.0.0"},
        {"role": "decode", "port": 18500, "devices": 5},
    ]
    p = plan(d)
    assert list(p) == ["colocated-0", "colocated-1", "prefill-0", "prefill-1", "decode-0"]
    c0, c1 = p["colocated-0"], p["colocated-1"]
    assert "--kv-transfer-config" not in c0.cmd
    assert (c0.port, c1.port) == (18300, 18301)
    assert (c0.env["CUDA_VISIBLE_DEVICES"], c1.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert c0.devices == "0,1" and c0.startup_timeout == 9.0
    assert p["prefill-1"].env["CUDA_VISIBLE_DEVICES"] == "7"
    assert p["decode-0"].env["CUDA_VISIBLE_DEVICES"] == "5"  # a bare int is one GPU id
    # bound to all interfaces, reached on loopback
    assert flag(p["prefill-1"].cmd, "--host") == "0.0.0.0"
    assert p["prefill-1"].url == "http://127.0.0.1:18401"
    assert p["decode-0"].startup_timeout == 5.0


def test_mapping_args_become_json_and_shell_line_is_quoted() -> None:
    d = base()
    d["instances"][1]["args"] = [
        "--speculative-config",
        {"method": "mtp", "num_speculative_tokens": 3},
    ]
    dec = plan(d)["decode-0"]
    assert json.loads(flag(dec.cmd, "--speculative-config")) == {
        "method": "mtp",
        "num_speculative_tokens": 3,
    }
    line = dec.shell_line()
    assert line.startswith("env PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES='' ")
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'""" in line


def test_custom_command_prefixes() -> None:
    specs = Topology.from_dict(base()).plan(Path("/l"), serve_cmd=["S"], proxy_cmd=["P", "x"])
    assert [s.cmd[:2] for s in specs] == [("S", "ckpt/tiny"), ("S", "ckpt/tiny"), ("P", "x")]
