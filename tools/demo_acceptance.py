"""Speculative acceptance of the demo model measured through ``pdserve serve`` (issue 18).

    python3 tools/demo_acceptance.py [--checkpoint assets/demo-glm5] [--json OUT]
        [--methods mtp1,mtp2,mtp3,ngram3] [--num-prompts 32] [--max-tokens 64]

For each method it starts one ``pdserve serve`` on the checkpoint (127.0.0.1, a free
port, CPU float32 unless --device/--dtype say otherwise) with that
``--speculative-config``, sends the held-out prompts (greedy, ``max_tokens`` 64, at most
--concurrency in flight), reads the spec-decode counters from its ``/metrics``
(``pdserve:spec_decode_num_drafts``, ``..._draft_tokens``, ``..._accepted_tokens`` and
``..._accepted_tokens_per_pos``) and stops it. Reported per method: the acceptance rate
(accepted / drafted), the mean acceptance length (1 + accepted / verify steps) and the
acceptance rate per draft position (accepted at position i / verify steps); the
completions of every method must be the same text (greedy verification is exact).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from train_demo import completion_parses  # noqa: E402

METHODS: dict[str, dict[str, Any]] = {
    "mtp1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp3": {"method": "mtp", "num_speculative_tokens": 3},
    # n-gram lookup in the request's own tokens: the longest match of 5 down to 2 tokens
    "ngram3": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },  # fmt: skip
}
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return bytes(r.read())


def spec_counters(metrics: str) -> dict[str, Any]:
    """The spec-decode counters of one instance's /metrics text."""
    out: dict[str, Any] = {c: 0.0 for c in COUNTERS}
    per_pos: dict[int, float] = {}
    for line in metrics.splitlines():
        if not line.startswith("pdserve:spec_decode_"):
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0].removeprefix("pdserve:spec_decode_").removesuffix("_total")
        if base == "num_accepted_tokens_per_pos":
            pos = int(name.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
        elif base in out:
            out[base] += float(value)
    out["per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


class Server:
    """One ``pdserve serve`` child process, stopped on exit (by its own pid)."""

    def __init__(self, args: argparse.Namespace, spec: dict[str, Any], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve", "serve", args.checkpoint,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "demo",
               "--device", args.device, "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.concurrency),
               "--speculative-config", json.dumps(spec)]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited: {self.log.read_text()[-3000:]}")
            try:
                http(self.url + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("pdserve serve did not become healthy in 300 s")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def measure(args: argparse.Namespace, name: str, prompts: list[str], log: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with Server(args, METHODS[name], log) as srv:
        started = time.monotonic() - t0

        def complete(prompt: str) -> dict[str, Any]:
            body = {"model": "demo", "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0.0}  # fmt: skip
            return dict(json.loads(http(srv.url + "/v1/completions", body, args.timeout)))

        t1 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            resps = list(pool.map(complete, prompts))
        run_s = time.monotonic() - t1
        c = spec_counters(http(srv.url + "/metrics").decode())
    texts = [r["choices"][0]["text"] for r in resps]
    hit = [r["usage"]["completion_tokens"] >= args.max_tokens for r in resps]
    verifies = max(1.0, c["num_drafts"])
    drafted = c["num_draft_tokens"]
    return {
        "spec": METHODS[name],
        "verify_steps": int(c["num_drafts"]),
        "drafted": int(drafted),
        "accepted": int(c["num_accepted_tokens"]),
        "acceptance_rate": c["num_accepted_tokens"] / drafted if drafted else None,
        "mean_acceptance_length": 1 + c["num_accepted_tokens"] / verifies,
        "acceptance_per_pos": [n / verifies for n in c["per_pos"]],
        "completion_tokens": sum(r["usage"]["completion_tokens"] for r in resps),
        "parse_share": sum(
            completion_parses(p, t, h)[0] for p, t, h in zip(prompts, texts, hit, strict=True)
        ) / max(1, len(prompts)),
        "startup_s": round(started, 1),
        "run_s": round(run_s, 1),
        "texts": texts,
    }  # fmt: skip


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['checkpoint']}: {report['num_prompts']} held-out prompts, greedy, "
        f"max_tokens {report['max_tokens']}, {report['device']} {report['dtype']} "
        f"(pdserve serve, /metrics)",
        "| method | k | verify steps | drafted | accepted | acceptance rate | mean accept len "
        "| per position (pos 0, 1, 2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["methods"].items():
        if "error" in r:
            lines.append(f"| {name} | | failed: {r['error']} |")
            continue
        rate = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        pos = ", ".join(f"{x:.3f}" for x in r["acceptance_per_pos"])
        lines.append(
            f"| {r['spec']['method']} | {r['spec']['num_speculative_tokens']} "
            f"| {r['verify_steps']} | {r['drafted']} | {r['accepted']} | {rate} "
            f"| {r['mean_acceptance_length']:.3f} | {pos} |"
        )
    lines.append(f"same completions in every method: {report['same_completions']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(ROOT / "assets" / "demo-glm5"))
    ap.add_argument(
        "--prompts", default=None, help="default: the checkpoint's heldout_prompts.json"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (bounded)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [m for m in args.methods.split(",") if m]
    unknown = set(names) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)} (choose from {', '.join(METHODS)})")
    prompts_path = Path(args.prompts or Path(args.checkpoint) / "heldout_prompts.json")
    prompts = json.loads(prompts_path.read_text())[: args.num_prompts]
    os.environ.setdefault("PDSERVE_LOG_LEVEL", "WARNING")
    report: dict[str, Any] = {
        "checkpoint": args.checkpoint, "num_prompts": len(prompts),
        "max_tokens": args.max_tokens, "device": args.device, "dtype": args.dtype,
        "concurrency": args.concurrency, "methods": {},
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="demo-acceptance-"))
    for name in names:
        try:
            report["methods"][name] = measure(args, name, prompts, logs / f"{name}.log")
        except Exception as e:  # noqa: BLE001 (reported in the table and the exit status)
            report["methods"][name] = {"error": f"{type(e).__name__}: {e}"}
        r = report["methods"][name]
        print(f"{name}: " + json.dumps({k: v for k, v in r.items() if k != "texts"}), flush=True)
    texts = [r["texts"] for r in report["methods"].values() if "texts" in r]
    report["same_completions"] = all(t == texts[0] for t in texts)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    failed = any("error" in r for r in report["methods"].values())
    return 1 if failed or not report["same_completions"] else 0


if __name__ == "__main__":
    sys.exit(main())
