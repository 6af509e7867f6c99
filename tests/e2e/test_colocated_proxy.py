"""Two colocated CPU instances behind the proxy, started by the launcher: the proxy
spreads greedy requests over both and its answers equal a direct call to one instance."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx

from pdserve.serving.launch.launcher import Launcher
from pdserve.serving.launch.topology import Topology

from .conftest import free_ports, metric


async def _complete(c: httpx.AsyncClient, url: str, prompt: list[int], stream: bool) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        r = await c.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
    text = ""
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(ch.get("text", "") for ch in chunk["choices"])
    return text


def test_two_colocated_replicas_behind_the_proxy(tiny_llama: Path, tmp_path: Path) -> None:
    proxy_port, a, b = free_ports(3)
    topo = {
        "model": str(tiny_llama),
        "served_model_name": "tiny",
        "common_args": ["--dtype", "float32", "--max-model-len", "512"],
        "startup_timeout": 120,
        "grace_period": 10,
        "proxy": {"host": "127.0.0.1", "port": proxy_port, "args": ["--health-interval", "1"]},
        "instances": [{"role": "colocated", "port": p, "devices": "cpu"} for p in (a, b)],
    }
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    proxy = f"http://127.0.0.1:{proxy_port}"
    replicas = [f"http://127.0.0.1:{p}" for p in (a, b)]
    with (
        open(os.devnull, "w") as quiet,
        Launcher(Topology.from_dict(topo), log_dir=tmp_path / "logs", out=quiet) as launcher,
    ):
        proxy_spec = next(ch.spec for ch in launcher.children if ch.spec.role == "proxy")
        assert proxy_spec.cmd[4:7] == ("--colocated", *replicas)

        async def run() -> tuple[list[str], list[str]]:
            async with httpx.AsyncClient(timeout=60) as c:
                via = await asyncio.gather(
                    *(_complete(c, proxy, p, stream=i % 2 == 0) for i, p in enumerate(prompts))
                )
                direct = [await _complete(c, replicas[0], p, stream=False) for p in prompts]
            return list(via), direct

        via_proxy, direct = asyncio.run(run())
        assert via_proxy == direct
        assert all(via_proxy)
        # both replicas served a share; the proxy counted them under pool="colocated"
        served = [metric(u, "pdserve:request_success_total") for u in replicas]
        assert served[1] > 0 and served[0] > len(prompts), served
        name = "pdserve:proxy_requests_total"
        ok = [
            metric(proxy, name, pool="colocated", instance=u, outcome="success") for u in replicas
        ]
        assert sum(ok) == len(prompts) and min(ok) > 0, ok
        models = httpx.get(f"{proxy}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert httpx.get(f"{proxy}/v1/models/tiny", timeout=10).json()["id"] == "tiny"
        tokens = httpx.post(f"{proxy}/tokenize", json={"prompt": "a b"}, timeout=10).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        health = httpx.get(f"{proxy}/health", timeout=10).json()
        assert health["colocated"] == {"healthy": 2, "total": 2}
