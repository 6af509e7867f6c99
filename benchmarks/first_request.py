"""Where does the first request's extra TTFT go? Launches `pdserve serve`, then sends one
request at a time (a new connection each) and prints every TTFT: a few short prompts
first, then ~1K-token prompts, so the short ones show the serving path's first-use cost
apart from the GPU work of a long prompt.

    python3 benchmarks/first_request.py --ckpt /tmp/llama-8b --out $OUT/first_request.json
        [--devices 0] [pdserve serve flags, e.g. --dtype bfloat16 --max-model-len 4096]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve.serving.launch.launcher import Launcher  # noqa: E402
from pdserve.serving.launch.topology import Topology  # noqa: E402


def ttft_ms(url: str, prompt: list[int], max_tokens: int = 4) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.Client(timeout=60) as c:
        t = time.perf_counter()
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - t
    if first is None:
        raise RuntimeError("no streamed chunk")
    return first * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--devices", default="0", help='"cpu" or GPU ids, as in a topology')
    ap.add_argument("--plan", default="8,8,8,1024,1024,1024,1024")
    ap.add_argument("--max-token-id", type=int, default=30000)
    args, serve_args = ap.parse_known_args(argv)  # the rest goes to `pdserve serve`
    topo = {
        "model": args.ckpt,
        "served_model_name": "m",
        "common_args": serve_args,
        "startup_timeout": 300,
        "instances": [{"role": "colocated", "port": args.port, "devices": args.devices}],
    }
    url = f"http://127.0.0.1:{args.port}"
    rng = random.Random(0)
    rows = []
    with Launcher(Topology.from_dict(topo), log_dir=Path(args.out).parent / "first_request_logs"):
        for n in map(int, args.plan.split(",")):
            ms = ttft_ms(url, [rng.randrange(10, args.max_token_id) for _ in range(n)])
            rows.append({"prompt_tokens": n, "ttft_ms": round(ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"serve_args": serve_args, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
