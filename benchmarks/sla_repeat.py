"""Is ``bench sla``'s capacity repeatable at its default sample size (200 prompts a point,
or 10 s of requests at the point's rate when that is more)?

Starts one ``pdserve serve`` of a tiny random checkpoint on the CPU, runs the same
``bench sla`` rate search against it ``--runs`` times (fresh prompts each run: another
seed), and reports each capacity and the spread, ``max/min - 1``, which the acceptance
wants within 10%. Needs a quiet machine: the server shares the CPU with the load
generator, and any other load moves the capacity.

    python3 benchmarks/sla_repeat.py --out $OUT/sla_repeat.json

Exit status 0 when every run found a capacity and the spread is at most ``--max-spread``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _wait(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not healthy after {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="sla_repeat.json")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--port", type=int, default=18733)
    ap.add_argument("--max-spread", type=float, default=0.10)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: bench sla's")
    ap.add_argument(
        "--sla-args",
        nargs=argparse.REMAINDER,
        default=["--random-input-len", "128", "--random-output-len", "32", "--start", "8"],
        help="further bench sla flags (default: short prompts, start at 8 req/s)",
    )
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    py = [sys.executable, "-m", "pdserve"]
    work = Path(tempfile.mkdtemp(prefix="sla-repeat-"))
    ckpt = work / "tiny-llama"
    subprocess.run(
        [*py, "make-checkpoint", "--arch", "LlamaForCausalLM", "--preset", "tiny",
         "--out", str(ckpt)], check=True, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [*py, "serve", str(ckpt), "--port", str(args.port), "--dtype", "float32",
         "--max-model-len", "512", "--disable-uvicorn-access-log"],
        env={**env, "CUDA_VISIBLE_DEVICES": ""}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    runs = []
    try:
        _wait(url, 180)
        for k in range(args.runs):
            result = work / f"run{k}.json"
            cmd = [*py, "bench", "sla", "--base-url", url, "--tokenizer", str(ckpt),
                   "--seed", str(1000 * (k + 1)), "--disable-tqdm", "--no-plot",
                   "--result-dir", str(work), "--result-filename", result.name,
                   *args.sla_args]  # fmt: skip
            if args.num_prompts is not None:
                cmd += ["--num-prompts", str(args.num_prompts)]
            t0 = time.monotonic()
            with open(work / f"run{k}.log", "w") as log:
                subprocess.run(cmd, env=env, stdout=log, stderr=log, check=False)
            data = json.loads(result.read_text())
            (ep,) = data["endpoints"]
            runs.append({"run": k, "capacity": ep["capacity"], "seconds": time.monotonic() - t0,
                         "num_prompts": data["num_prompts"],
                         "points": [(p["x"], p["passed"], p["why"]) for p in ep["points"]]})  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    caps = [r["capacity"] for r in runs]
    spread = max(caps) / min(caps) - 1 if all(caps) else None
    print(f"{'run':>3} {'prompts':>8} {'capacity req/s':>15} {'seconds':>8}")
    for r in runs:
        print(f"{r['run']:>3} {r['num_prompts']:>8} {r['capacity']!s:>15} {r['seconds']:>8.0f}")
    print(f"spread (max/min - 1): {spread if spread is None else f'{spread:.1%}'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "spread": spread}, indent=1))
    return 0 if spread is not None and spread <= args.max_spread else 1


if __name__ == "__main__":
    sys.exit(main())
