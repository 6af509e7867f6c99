"""``pdserve launch`` on a Ray cluster: a head and a second node started on this machine
(:mod:`.ray_cluster`, shared by the module's tests), the prefill pinned to the head and
the decode to the other node.

- A 1P1D topology of the tiny CPU model, P/D over tcp between the nodes, behind the
  proxy: the greedy outputs through the proxy equal the offline ``LLM``'s, the decode
  instance received the prompts' KV from the prefill instance, each instance bound its
  own node's address, and after SIGTERM the launcher leaves no actor, placement group or
  process.
- Stand-in instances: a dead instance restarts through its actor on the same node; a
  death past the restart limit stops the topology and removes everything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from pdserve.serving.launch.launcher import Launcher, LaunchError
from pdserve.serving.launch.ray_placement import RayChild
from pdserve.serving.launch.topology import Topology

from .conftest import FAKE_SERVER, MARKER_VAR, free_ports, marked_pids, wait_until

ray = pytest.importorskip("ray", reason="needs ray (scripts/setup-venv test installs it)")

from .ray_cluster import HEAD_IP, NODE_IP, RayCluster, start_cluster  # noqa: E402

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    c = start_cluster()
    try:
        yield c
    finally:
        c.stop()


@contextlib.contextmanager
def driver(address: str) -> Iterator[None]:
    """This process connected to the cluster (to look at actors and placement groups),
    unless it already is (an in-process launcher's connection)."""
    if ray.is_initialized():
        yield
        return
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init takes it; pytest's comes back
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
        signal.signal(signal.SIGTERM, sigterm)
        yield
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def metric(url: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, (name, labels)
    return total


def complete(proxy: str, prompt: list[int]) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{proxy}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def reference(ckpt: Path, prompts: list[list[int]]) -> list[str]:
    from pdserve import LLM, SamplingParams

    llm = LLM(str(ckpt), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].text for o in outs]


def cluster_state(launch_id: str = "") -> tuple[dict[str, str], list[str], bool]:
    """(placement group name -> state, named actors, every resource free); only the
    placement groups of launch ``launch_id`` (named ``pdserve-<launch id>-<process>``)."""
    from ray.util.placement_group import placement_group_table

    mine = f"pdserve-{launch_id}-"
    pgs = {str(v["name"]): str(v["state"]) for v in placement_group_table().values()}
    actors = [str(a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)]
    free = ray.available_resources() == ray.cluster_resources()
    return {k: v for k, v in pgs.items() if k.startswith(mine)}, actors, free


def settled(address: str, launch_id: str) -> tuple[dict[str, str], list[str]]:
    """A launch's placement groups, and all named actors, once the cluster has every
    resource back."""
    with driver(address):
        wait_until(lambda: cluster_state()[2], 20, "the cluster to take its resources back")
        pgs, actors, _ = cluster_state(launch_id)
    return pgs, actors


def test_1p1d_on_two_ray_nodes_matches_offline_and_cleans_up(
    cluster: RayCluster, launcher_ckpt: Path, tmp_path: Path, marker: str
) -> None:
    proxy_port, p_port, d_port = free_ports(3)
    topo = {
        "model": str(launcher_ckpt),
        "served_model_name": "tiny",
        "log_dir": str(tmp_path / "logs"),
        "env": {MARKER_VAR: marker},
        "common_args": ["--dtype", "float32", "--max-model-len", "256"],
        "startup_timeout": 150,
        "grace_period": 15,
        "on_failure": "stop",
        "placement": {"backend": "ray", "address": cluster.address, "placement_timeout": 60},
        "kv_transfer": {"connector": "PdConnector", "extra_config": {"transport": "tcp"}},
        "proxy": {"host": "127.0.0.1", "port": proxy_port},
        "instances": [
            {
                "role": "prefill",
                "port": p_port,
                "devices": "cpu",
                "placement": {"resources": {"node_a": 1}},
            },
            {
                "role": "decode",
                "port": d_port,
                "devices": "cpu",
                "placement": {"resources": {"node_b": 1}},
            },
        ],
    }
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 17, 33, 48)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.serving.launch", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    state_file = tmp_path / "logs" / "launch.json"
    try:
        expected = reference(launcher_ckpt, prompts)  # while the topology starts

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"launcher exited early: {proc.communicate()}")
            return state_file.exists()

        wait_until(ready, 200, "the topology on Ray to be ready")
        procs = {p["name"]: p for p in json.loads(state_file.read_text())["processes"]}
        # each instance bound its own node's address; the proxy runs here
        assert urlsplit(procs["prefill-0"]["url"]).hostname == HEAD_IP
        assert urlsplit(procs["decode-0"]["url"]).hostname == NODE_IP
        assert procs["prefill-0"]["node_id"] != procs["decode-0"]["node_id"]
        proxy, decode = procs["proxy"]["url"], procs["decode-0"]["url"]
        assert proxy == f"http://127.0.0.1:{proxy_port}"
        with driver(cluster.address):
            _, actors, _ = cluster_state()
            launch_id = actors[0].split("-")[1]  # pdserve-<launch id>-<process>
            pgs, _, _ = cluster_state(launch_id)
        assert sorted(actors) == [f"pdserve-{launch_id}-{n}" for n in ("decode-0", "prefill-0")]
        assert sorted(pgs) == sorted(actors) and set(pgs.values()) == {"CREATED"}

        assert [complete(proxy, p) for p in prompts] == expected
        # decode computed the last prompt token itself and got the rest over tcp from
        # the prefill instance on the other node
        assert metric(decode, "pdserve:kv_transfer_time_seconds_count") == len(prompts)
        assert metric(
            decode, "pdserve:prompt_tokens_by_source_total", source="external_kv_transfer"
        ) == sum(len(p) - 1 for p in prompts)
        prefill_log = (tmp_path / "logs" / "prefill-0.log").read_text()
        assert "KV server for engine" in prefill_log and f" on {HEAD_IP}:" in prefill_log

        served = marked_pids(marker)  # both instances (API servers, engine cores), proxy
        assert len(served) >= 5, served
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "stopping the topology" in err and "placement groups of launch" in err
    assert "SIGTERM received" not in err  # Ray's crash report is not our stop
    assert marked_pids(marker) == []
    pgs, actors = settled(cluster.address, launch_id)
    assert actors == [] and len(pgs) == 2 and set(pgs.values()) == {"REMOVED"}, (pgs, actors)


def starts(rec: Path, port: int) -> list[dict[str, Any]]:
    path = rec / f"serve-{port}.jsonl"
    if not path.exists():
        return []
    events = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [e for e in events if e["event"] == "start"]


def test_a_dead_instance_restarts_through_its_actor_then_a_failure_removes_everything(
    cluster: RayCluster, tmp_path: Path, marker: str
) -> None:
    """Stand-in instances (``fake_server.py``): a killed decode process comes back on its
    node through its actor; killed past ``restart.max_restarts`` it fails the topology,
    and the launcher stops the rest, kills the actors and removes the placement groups."""
    p_port, d_port, proxy_port = free_ports(3)
    rec = tmp_path / "rec"
    rec.mkdir()
    instances = [
        {"role": role, "port": port, "devices": "cpu", "placement": {"resources": {res: 1}}}
        for role, port, res in (("prefill", p_port, "node_a"), ("decode", d_port, "node_b"))
    ]
    t = Topology.from_dict(
        {
            "model": "fake-model",
            "env": {"FAKE_RECORD_DIR": str(rec), MARKER_VAR: marker},
            "log_dir": str(tmp_path / "logs"),
            "grace_period": 5,
            "startup_timeout": 30,
            "restart": {"max_restarts": 1, "backoff": 0.1},
            "placement": {"backend": "ray", "address": cluster.address},
            "kv_transfer": {"connector": "PdConnector"},
            "proxy": {"port": proxy_port},
            "instances": instances,
        }
    )
    fake = (sys.executable, str(FAKE_SERVER))
    la = Launcher(
        t,
        serve_cmd=(*fake, "serve"),
        proxy_cmd=(*fake, "proxy"),
        out=io.StringIO(),
        poll_interval=0.05,
    )
    la.start()
    assert la.ray is not None
    launch_id = la.ray.launch_id
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(la.wait()), daemon=True)
    th.start()
    try:

        def decode() -> Any:
            return next(c for c in la.children if c.spec.name == "decode-0")

        first = decode()
        assert isinstance(first, RayChild) and first.node.ip == NODE_IP
        (run,) = starts(rec, d_port)
        assert run["argv"][run["argv"].index("--host") + 1] == NODE_IP
        assert run["env"]["CUDA_VISIBLE_DEVICES"] == ""
        assert len(run["env"]["PDSERVE_PD_SECRET"]) >= 32  # it reached the node
        with driver(cluster.address):  # the launcher's own connection
            pgs, actors, _ = cluster_state(launch_id)
        assert sorted(actors) == [f"pdserve-{launch_id}-{n}" for n in ("decode-0", "prefill-0")]
        assert sorted(pgs) == sorted(actors) and set(pgs.values()) == {"CREATED"}

        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: len(starts(rec, d_port)) == 2, 30, "a restart")
        wait_until(lambda: decode().ready, 30, "the restarted decode to be ready")
        again = decode()
        assert again.restart == 1 and again.pid != first.pid and again.node == first.node
        assert starts(rec, d_port)[1]["argv"] == run["argv"]  # same node, port and command

        os.kill(again.pid, signal.SIGKILL)  # one death past max_restarts: a failure
        th.join(60)
    finally:
        la.request_stop()
        th.join(60)
    assert result == [1]
    assert marked_pids(marker) == []
    pgs, actors = settled(cluster.address, launch_id)
    assert actors == [] and len(pgs) == 2 and set(pgs.values()) == {"REMOVED"}, (pgs, actors)


def test_a_placement_no_node_can_take_fails_the_launch_and_is_removed(
    cluster: RayCluster, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    inst = {"role": "colocated", "port": port, "devices": "cpu"}
    inst["placement"] = {"resources": {"node_c": 1}}  # no node has it
    t = Topology.from_dict(
        {
            "model": "fake-model",
            "log_dir": str(tmp_path / "logs"),
            "placement": {"backend": "ray", "address": cluster.address, "placement_timeout": 2},
            "instances": [inst],
        }
    )
    fake = (sys.executable, str(FAKE_SERVER))
    la = Launcher(t, serve_cmd=(*fake, "serve"), out=io.StringIO(), poll_interval=0.05)
    with pytest.raises(LaunchError) as e:
        la.start()
    assert la.ray is not None and la.children == []
    msg = str(e.value)
    assert "no node could take the placement group of colocated-0 within 2s" in msg
    assert "'node_c': 1.0" in msg and "node_a: 1" in msg  # what it asked, what is free
    pgs, actors = settled(cluster.address, la.ray.launch_id)
    assert actors == [] and list(pgs.values()) == ["REMOVED"], pgs
