"""1PxD against colocated: the same `pdserve bench serve` load at several request rates,
or (``--sla``) the `pdserve bench sla` capacity of each topology.

For each topology, start it with the launcher, run the random dataset at every rate
(mean/p90 TTFT and TPOT), or search the largest Poisson rate meeting the SLA, then stop
it. Topologies (``--topologies``, in order):

- ``pd``: 1 prefill + 1 decode instance behind the proxy. On one GPU both share the card
  (``--gpu-memory-utilization`` split); ``--prefill-device``/``--decode-device`` give
  each its own GPU;
- ``colocated``: one instance on ``--device``;
- ``replicas``: one colocated instance per GPU of ``--device`` behind the proxy;
- ``tp``: one instance with ``--tensor-parallel-size`` = the GPUs of ``--device``.

A topology runs alone (they would share the GPUs), so ``--sla`` searches each in turn
and prints `bench sla --compare`'s table over them at the end, tokens per second per GPU
included.

    # H200, one call (about 6 minutes):
    python3 benchmarks/pd_bench.py --ckpt /tmp/llama-8b --device 0 --transport cuda_ipc \\
        --input-len 16384 --output-len 1000 --rates 0.5,1,1.5 --num-prompts 30 --out $OUT/pd.json
    # CPU smoke run of the same code path:
    python3 benchmarks/pd_bench.py --ckpt checkpoints/tiny-llama --device cpu --dtype float32 \\
        --input-len 64 --output-len 16 --rates 2,4 --num-prompts 10 --out /tmp/pd.json
    # two GPUs: SLA capacity of 1P1D (a GPU each), two replicas and TP2, 16384/1000:
    python3 benchmarks/pd_bench.py --ckpt /tmp/llama-8b --device 0,1 --prefill-device 0 \
        --decode-device 1 --topologies pd,replicas,tp --sla --num-prompts 24 --out $OUT/x2.json
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import asyncio  # noqa: E402

from pdserve.bench import sla as bench_sla  # noqa: E402
from pdserve.bench.serve import run_benchmark  # noqa: E402
from pdserve.serving.launch.launcher import Launcher  # noqa: E402
from pdserve.serving.launch.topology import Topology  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TOPOLOGIES = ("pd", "colocated", "replicas", "tp")


def _gpus(devices: str) -> list[str]:
    return [] if devices == "cpu" else devices.split(",")


def num_gpus(args: argparse.Namespace, kind: str) -> int:
    if kind == "pd":
        pd = {args.prefill_device or args.device, args.decode_device or args.device}
        return max(1, len({g for d in pd for g in _gpus(d)}))
    return max(1, len(_gpus(args.device)) if kind != "colocated" else 1)


def topology(args: argparse.Namespace, kind: str) -> dict:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.input_len + args.output_len + 64)]
    base = {"model": args.ckpt, "served_model_name": "m", "common_args": common,
            "startup_timeout": 600}  # fmt: skip
    gpus = _gpus(args.device)
    if kind == "replicas":  # one colocated instance per GPU, the proxy in front
        n = max(1, len(gpus))
        return {**base, "proxy": {"host": "127.0.0.1", "port": _port()}, "instances": [
            {"role": "colocated", "port": _port(), "devices": args.device, "replicas": n}
        ]}  # fmt: skip
    if kind == "tp":
        tp = ["--tensor-parallel-size", str(max(1, len(gpus)))]
        return {**base, "instances": [
            {"role": "colocated", "port": _port(), "devices": args.device, "args": tp}
        ]}  # fmt: skip
    if kind == "pd":
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
            **base,
            "kv_transfer": {
                "connector": "PdConnector",
                "extra_config": {"transport": args.transport},
            },
            "proxy": {"host": "127.0.0.1", "port": _port()},
            "instances": instances,
        }
    return {
        **base,
        "instances": [{"role": "colocated", "port": _port(), "devices": args.device}],
    }


LABELS = {"pd": "1P1D", "colocated": "colocated", "replicas": "replicas", "tp": "TP"}


def search(args: argparse.Namespace, kind: str, url: str) -> dict:
    """`bench sla` against one running topology: its endpoint record."""
    sargs = bench_sla.default_args(
        base_url=url, model="m", tokenizer=args.ckpt, dataset_name="random",
        random_input_len=args.input_len, random_output_len=args.output_len,
        num_prompts=args.num_prompts, num_warmups=1, start=args.sla_start,
        tolerance=args.sla_tolerance, sla_ttft_ms=args.sla_ttft_ms, sla_tpot_ms=args.sla_tpot_ms,
        min_point_seconds=args.sla_min_point_seconds,
        disable_tqdm=True, ignore_eos=True,
    )  # fmt: skip
    label, gpus = LABELS[kind], num_gpus(args, kind)
    sla = bench_sla.SLA(args.sla_ttft_ms, args.sla_tpot_ms, "mean")
    res = asyncio.run(bench_sla.search_endpoint(sargs, sla, label, url, gpus, own_metrics=True))
    rec = bench_sla.endpoint_record(label, url, gpus, res)
    print(json.dumps({k: rec[k] for k in ("label", "capacity", "at_capacity")}), flush=True)
    return rec


PD_COUNTERS = (
    "pdserve:kv_transfer_failures_total",
    "pdserve:kv_leases_expired_total",
    "pdserve:num_requests_kv_held_for_decode",
)


def pd_health(launcher: Launcher) -> dict:
    """Each P/D instance's transfer failures, expired leases and KV still held (after a
    short wait: decode's done notices free what it read), scraped before the stop."""
    import urllib.request

    time.sleep(3.0)
    out: dict = {}
    for c in launcher.children:
        if c.spec.role not in ("prefill", "decode"):
            continue
        with urllib.request.urlopen(f"{c.spec.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        got = {}
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in PD_COUNTERS:
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out[c.spec.name] = got
    return out


def run(args: argparse.Namespace, kind: str) -> list[dict]:
    topo = topology(args, kind)
    url_port = topo["proxy"]["port"] if "proxy" in topo else topo["instances"][0]["port"]
    url = f"http://127.0.0.1:{url_port}"
    rows = []
    log_dir = Path(args.log_dir) / kind if args.log_dir else None
    with Launcher(Topology.from_dict(topo), log_dir=log_dir) as launcher:
        if args.sla:
            rows = [search(args, kind, url)]
        for rate in [] if args.sla else map(float, args.rates.split(",")):
            t0 = time.perf_counter()
            r = run_benchmark(
                base_url=url,
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
                "topology": LABELS[kind],
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
        if kind == "pd":
            health = pd_health(launcher)
            print("P/D instances after the run:", json.dumps(health), flush=True)
            for r in rows:
                r["pd_health"] = health
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    ap.add_argument("--sla", action="store_true", help="search each topology's SLA capacity")
    ap.add_argument("--sla-ttft-ms", type=float, default=2500.0)
    ap.add_argument("--sla-tpot-ms", type=float, default=20.0)
    ap.add_argument("--sla-start", type=float, default=0.5, help="first rate of the search")
    ap.add_argument("--sla-min-point-seconds", type=float, default=10.0,
                    help="bench sla --min-point-seconds")  # fmt: skip
    ap.add_argument("--sla-tolerance", type=float, default=0.2)
    args = ap.parse_args(argv)
    for t in args.topologies.split(","):
        if t not in TOPOLOGIES:
            ap.error(f"--topologies: unknown topology {t!r} ({', '.join(TOPOLOGIES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for t in args.topologies.split(","):
        rows += run(args, t)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    if args.sla:
        print("\n" + bench_sla.format_table(rows, "rate"))
        return 0
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
