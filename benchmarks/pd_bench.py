"""1PxD against colocated: the same `pdserve bench serve` load at several request rates.

For each topology (1 prefill + 1 decode instance behind the proxy, then one colocated
instance), start it with the launcher, run the random dataset at every rate, record
mean/p90 TTFT and TPOT, stop it. On one GPU both P/D instances share the card
(``--gpu-memory-utilization`` split) and move KV over ``cuda_ipc``.

    # H200, one call (about 6 minutes):
    python3 benchmarks/pd_bench.py --ckpt /tmp/llama-8b --device 0 --transport cuda_ipc \\
        --input-len 16384 --output-len 1000 --rates 0.5,1,1.5 --num-prompts 30 --out $OUT/pd.json
    # CPU smoke run of the same code path:
    python3 benchmarks/pd_bench.py --ckpt checkpoints/tiny-llama --device cpu --dtype float32 \\
        --input-len 64 --output-len 16 --rates 2,4 --num-prompts 10 --out /tmp/pd.json
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve.bench.serve import run_benchmark  # noqa: E402
from pdserve.serving.launch.launcher import Launcher  # noqa: E402
from pdserve.serving.launch.topology import Topology  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def topology(args: argparse.Namespace, disaggregated: bool) -> dict:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.input_len + args.output_len + 64)]
    if disaggregated:
        share = (
            ["--gpu-memory-utilization", str(args.pd_memory_share)] if args.device != "cpu" else []
        )
        pdev = args.prefill_device or args.device
        ddev = args.decode_device or args.device
        if pdev != ddev:  # a GPU each: no need to split one card's memory
            share = []
        instances = [
            {"role": "prefill", "port": _port(), "devices": pdev, "args": share},
            {"role": "decode", "port": _port(), "devices": ddev, "args": share},
        ]
        return {
            "model": args.ckpt,
            "served_model_name": "m",
            "common_args": common,
            "startup_timeout": 600,
            "kv_transfer": {
                "connector": "PdConnector",
                "extra_config": {"transport": args.transport},
            },
            "proxy": {"host": "127.0.0.1", "port": _port()},
            "instances": instances,
        }
    return {
        "model": args.ckpt,
        "served_model_name": "m",
        "common_args": common,
        "startup_timeout": 600,
        "instances": [{"role": "colocated", "port": _port(), "devices": args.device}],
    }


def run(args: argparse.Namespace, disaggregated: bool) -> list[dict]:
    topo = topology(args, disaggregated)
    url_port = topo["proxy"]["port"] if disaggregated else topo["instances"][0]["port"]
    rows = []
    log_dir = (
        Path(args.log_dir) / ("pd" if disaggregated else "colocated") if args.log_dir else None
    )
    with Launcher(Topology.from_dict(topo), log_dir=log_dir):
        for rate in map(float, args.rates.split(",")):
            t0 = time.perf_counter()
            r = run_benchmark(
                base_url=f"http://127.0.0.1:{url_port}",
                model="m",
                tokenizer=args.ckpt,
                dataset_name="random",
                random_input_len=args.input_len,
                random_output_len=args.output_len,
                num_prompts=args.num_prompts,
                request_rate=rate,
                seed=int(rate * 100),
                disable_tqdm=True,
                percentile_metrics="ttft,tpot,itl,e2el",
                metric_percentiles="90",
            )
            row = {
                "topology": "1P1D" if disaggregated else "colocated",
                "rate": rate,
                "wall_s": time.perf_counter() - t0,
                **{
                    k: r.get(k)
                    for k in (
                        "completed",
                        "failed",
                        "output_throughput",
                        "mean_ttft_ms",
                        "p90_ttft_ms",
                        "mean_tpot_ms",
                        "p90_tpot_ms",
                    )
                },
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            partial = Path(args.out).with_suffix(".partial.jsonl")
            with partial.open("a") as f:  # survives a kill of the whole run
                f.write(json.dumps(row) + "\n")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="0", help='"cpu" or GPU ids, as in a topology file')
    ap.add_argument("--prefill-device", help="GPU ids of the prefill instance (default --device)")
    ap.add_argument("--decode-device", help="GPU ids of the decode instance (default --device)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transport", default="cuda_ipc")
    ap.add_argument("--pd-memory-share", type=float, default=0.42)
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--log-dir", help="instance logs go here (default: a temporary folder)")
    ap.add_argument("--topologies", default="pd,colocated", help="which to run, in order")
    args = ap.parse_args()
    rows = []
    for t in args.topologies.split(","):
        if t not in ("pd", "colocated"):
            ap.error(f"--topologies: unknown topology {t!r} (pd, colocated)")
        rows += run(args, t == "pd")
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(
        f"\n{'topology':>10} {'rate':>5} {'ok':>4} {'out tok/s':>9} {'mean TTFT':>10} {'p90 TTFT':>9} "
        f"{'mean TPOT':>10} {'p90 TPOT':>9}"
    )
    for r in rows:
        print(
            f"{r['topology']:>10} {r['rate']:>5} {r['completed']:>4} {r['output_throughput']:>9.0f} "
            f"{r['mean_ttft_ms']:>10.0f} {r['p90_ttft_ms']:>9.0f} {r['mean_tpot_ms']:>10.2f} "
            f"{r['p90_tpot_ms']:>9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
