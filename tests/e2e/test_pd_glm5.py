"""The GLM-5 family through a real 1P1D topology (launcher + instances + proxy, CPU): the
reference deployment's shape (MTP drafting, 1 draft token on the prefill, 3 on the decode,
padded first decode step) gives the colocated server's greedy tokens (no speculation
there), and every cache group (MLA latents, indexer keys, the MTP layer's latents) of
each prompt block crosses the wire."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx

from _polling import wait_until
from pdserve import LLM
from pdserve.serving.launch.launcher import Launcher
from pdserve.serving.launch.topology import Topology

from .conftest import metric
from .test_pd_topology import _complete, _topology, _usage_zero

BLOCK = 16


def _spec(k: int) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})]


def test_glm5_1p1d_with_mtp_matches_colocated(tiny_glm5: Path, tmp_path: Path) -> None:
    topo, ports = _topology(tiny_glm5, prefill=1, colocated=True)
    prefill, decode, _ = topo["instances"]
    prefill["args"] = _spec(1)
    decode["args"] = _spec(3)
    topo["proxy"]["args"] = ["--spec-scrape-interval", "0.2"]
    rng = random.Random(5)
    # several times index_topk (16) so the sparse selection decides; distinct first
    # tokens so no prompt is a prefix-cache hit of another
    prompts = [
        [3 + i] + [rng.randrange(3, 1000) for _ in range(rng.randrange(20, 90))] for i in range(12)
    ]
    spec3 = {"method": "mtp", "num_speculative_tokens": 3}
    cfg = LLM(str(tiny_glm5), dtype="float32", max_model_len=1024, speculative_config=spec3)
    groups = cfg.engine.runner.kv_cache_config.groups
    assert cfg.engine.runner.kv_cache_config.block_size == BLOCK
    per_block = {g.name: g.bytes_per_block for g in groups}
    assert {g.name: len(g.layer_names) for g in groups} == {"mla": 5, "indexer": 5}  # 4 + MTP
    del cfg
    with (
        open(os.devnull, "w") as quiet,
        Launcher(Topology.from_dict(topo), log_dir=tmp_path / "logs", out=quiet),
    ):
        urls = {
            r: f"http://127.0.0.1:{ports[r]}" for r in ("proxy", "prefill", "decode", "colocated")
        }

        async def run(url: str) -> list[tuple[int, str, dict]]:
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(
                    *(
                        _complete(c, url, p, stream=i % 2 == 0, max_tokens=12)
                        for i, p in enumerate(prompts)
                    )
                )

        pd = asyncio.run(run(urls["proxy"]))
        ref = asyncio.run(run(urls["colocated"]))
        assert [s for s, _, _ in pd] == [200] * len(prompts), pd
        assert [t for _, t, _ in pd] == [t for _, t, _ in ref]
        ext = metric(
            urls["decode"], "pdserve:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        assert ext == sum(len(p) - 1 for p in prompts)
        # the decode drafted with MTP and padded its first step after each hand-off
        assert metric(urls["decode"], "pdserve:spec_decode_num_drafts_total") > 0
        assert metric(urls["decode"], "pdserve:spec_decode_num_padded_steps_total") > 0
        # ... and the proxy shows the decode pool's drafts
        name = "pdserve:spec_decode_num_draft_tokens_total"
        drafted = metric(urls["decode"], name)

        def proxy_sees_drafts() -> bool:
            return metric(urls["proxy"], name.replace(":", ":proxy_"), pool="decode") == drafted

        assert wait_until(proxy_sees_drafts, 5, step=0.1)
        # every group of every prompt block was read: the bytes moved are the prompt's
        # blocks times the bytes a block holds over all groups
        moved = metric(urls["decode"], "pdserve:kv_transfer_bytes_sum")
        blocks = sum(-(-(len(p) - 1) // BLOCK) for p in prompts)  # decode recomputes the last
        assert moved == blocks * sum(per_block.values()), (moved, per_block)
        # a JSON schema, a forced tool call and penalties, through the proxy with MTP
        # on the decode: the colocated server's answers (no speculation there)
        forced = [asyncio.run(_forced(urls[r])) for r in ("proxy", "colocated")]
        assert forced[0] == forced[1]
        (text, _, why), (_, calls, why_call), _ = forced[0]
        assert why == "stop" and set(json.loads(text or "")) == {"n", "s"}
        assert why_call == "tool_calls" and calls[0][0] == "get_weather"
        for url in urls.values():
            if url != urls["proxy"]:
                assert wait_until(lambda u=url: _usage_zero(u), 10, step=0.05), url


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    }
]


async def _forced(url: str) -> list[tuple[str | None, list[tuple[str, str]], str]]:
    """(content, [(name, arguments)], finish reason) of three greedy chat answers."""
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "s": {"type": "string", "maxLength": 6},
        },
        "required": ["n", "s"],
    }
    common = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 80}
    bodies = [
        {
            **common,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        },
        {**common, "tools": TOOLS, "tool_choice": "required"},
        {**common, "presence_penalty": 0.5, "frequency_penalty": 0.5, "max_tokens": 16},
    ]
    out = []
    async with httpx.AsyncClient(timeout=120) as c:
        for body in bodies:
            r = await c.post(f"{url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            calls = [
                (t["function"]["name"], t["function"]["arguments"])
                for t in ch["message"].get("tool_calls") or []
            ]
            out.append((ch["message"]["content"], calls, ch["finish_reason"]))
    return out
