"""Second GPU call: where the first request's time goes, host vs device time of a decode
step, and cuda_ipc KV transfer time between two instances sharing the GPU.

    python3 benchmarks/gpu_diag.py --ckpt /tmp/llama-8b --out $OUT/gpu_diag.json

``--device cpu`` runs the same code on a tiny Llama (made in a temporary folder unless
``--ckpt`` is given) at small sizes, the transfer over ``--transport tcp`` (cuda_ipc
needs a GPU): a smoke run of the script (tests/bench/test_bench_scripts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_suite import _sync, graph_replay_ms  # noqa: E402

VOCAB = 30000  # token ids drawn below this (--device cpu: the tiny model's vocabulary)


def _prompt(seed: int, n: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(10, VOCAB, (n,), generator=g).tolist()}


def first_request(llm: LLM, n: int = 1024) -> dict:
    """TTFT-like time (prefill + 1 token) of the first ``n``-token request vs later ones,
    split into runner phases (each phase synchronised)."""
    r = llm.engine.runner
    phases: dict[str, float] = {}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            _sync(r.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            _sync(r.device)
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
            return out

        return wrapper

    r.prep.prepare = timed("prepare_inputs", r.prep.prepare)  # type: ignore[method-assign]
    pipe = llm.engine.pipeline
    pipe.forward = timed("forward", pipe.forward)  # type: ignore[method-assign]
    r.sampler = timed("sample", r.sampler)  # type: ignore[assignment]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    for i in range(6):
        phases.clear()
        t0 = time.perf_counter()
        llm.generate(_prompt(100 + i, n), sp)
        out.append({"seconds": time.perf_counter() - t0, **dict(phases)})
    return {"first": out[0], "later": out[1:]}


def decode_split(llm: LLM, batch: int, ctx: int = 1024) -> dict:
    """Step time (host clock around engine.step) vs device time of the graph replay alone."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(batch):
        eng.add_request(
            llm.processor.make_request(f"s{batch}-{i}", _prompt(i, ctx)["prompt_token_ids"], sp)
        )
    while eng.scheduler.waiting or any(
        not q.output_token_ids for q in eng.scheduler.requests.values()
    ):
        eng.step()
    for _ in range(3):
        eng.step()
    steps = []
    for _ in range(15):
        _sync(llm.engine.runner.device)
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    replay_ms = graph_replay_ms(llm)  # the graph of the last step, None when it ran eagerly
    eng.abort_requests(list(eng.scheduler.requests))
    eng.step()
    return {
        "batch": batch,
        "ctx": ctx,
        "step_ms": statistics.median(steps) * 1e3,
        "graph_replay_ms": replay_ms,
    }


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server of {url} exited ({proc.returncode}): see its log")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy")


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ipc_transfer(
    ckpt: str,
    bw: float,
    lens: list[int],
    log_dir: Path,
    *,
    device: str = "cuda",
    transport: str = "cuda_ipc",
    ports: tuple[int, int] = (8301, 8302),
) -> list[dict]:
    import httpx

    from pdserve.core_types.pd_auth import SECRET_ENV, load_secret, new_secret
    from pdserve.serving.proxy.core import decode_body, prefill_body

    os.environ.setdefault(SECRET_ENV, new_secret())  # the instances' side channel (inherited)
    secret = load_secret()
    assert secret is not None
    common = [sys.executable, "-m", "pdserve", "serve", ckpt, "--max-model-len",
              str(max(lens) + 16), "--max-num-seqs", "8", "--enforce-eager",
              "--uvicorn-log-level", "warning"]  # fmt: skip
    if device == "cpu":
        common += ["--device", "cpu", "--dtype", "float32"]
    else:
        common += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.4"]
    procs = []
    urls = {}
    for role, port in zip(("kv_producer", "kv_consumer"), ports, strict=True):
        kvt = json.dumps(
            {
                "kv_connector": "PdConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"transport": transport},
            }
        )
        log = open(log_dir / f"{role}.log", "w")  # noqa: SIM115 (lives as long as the server)
        procs.append(
            subprocess.Popen(
                [*common, "--port", str(port), "--kv-transfer-config", kvt],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        urls[role] = f"http://127.0.0.1:{port}"
        if role == "kv_producer":  # the second instance sizes its memory after the first
            _wait_healthy(urls[role], procs[-1])
    _wait_healthy(urls["kv_consumer"], procs[-1])
    out = []
    try:
        with httpx.Client(timeout=600) as c:
            for n in [lens[0], *lens]:  # the first run warms both sides up
                prompt = _prompt(n, n)["prompt_token_ids"]
                body = {"model": ckpt, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                # both legs as the proxy sends them: one request id, params signed for it
                rid = {"X-Request-Id": f"diag-{len(out)}-{n}-{time.monotonic_ns()}"}
                t0 = time.perf_counter()
                p = c.post(urls["kv_producer"] + "/v1/completions", headers=rid,
                           json=prefill_body(body, secret, rid["X-Request-Id"]))  # fmt: skip
                p.raise_for_status()
                t1 = time.perf_counter()
                s0 = _metric(urls["kv_consumer"], "pdserve:kv_transfer_time_seconds_sum")
                b0 = _metric(urls["kv_consumer"], "pdserve:kv_transfer_bytes_sum")
                kv = p.json()["kv_transfer_params"]
                d = c.post(urls["kv_consumer"] + "/v1/completions", headers=rid,
                           json=decode_body(body, kv, secret, rid["X-Request-Id"]))  # fmt: skip
                d.raise_for_status()
                t2 = time.perf_counter()
                time.sleep(0.3)  # stats snapshots are sent every 100 ms
                xfer = _metric(urls["kv_consumer"], "pdserve:kv_transfer_time_seconds_sum") - s0
                nbytes = _metric(urls["kv_consumer"], "pdserve:kv_transfer_bytes_sum") - b0
                out.append(
                    {
                        "prompt_tokens": n,
                        "prefill_leg_s": t1 - t0,
                        "decode_leg_s": t2 - t1,
                        "transfer_s": xfer,
                        "bytes": nbytes,
                        "d2d_bound_s": 2 * nbytes / bw,
                        "decode_text_ok": bool(d.json().get("choices")),
                    }
                )
                print(json.dumps(out[-1]), flush=True)
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait(30)
    return out[1:]


def make_engine(ckpt: str, device: str) -> LLM:
    if device == "cpu":
        return LLM(ckpt, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)
    return LLM(
        ckpt, dtype="bfloat16", max_model_len=8192, gpu_memory_utilization=0.5, max_num_seqs=256
    )


def main(argv: list[str] | None = None) -> int:
    global VOCAB
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint folder (required on cuda; cpu: a tiny one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--copy-bw", type=float, default=4.24e12)
    ap.add_argument("--only-ipc", action="store_true")
    ap.add_argument("--transport", default="cuda_ipc", help="of the transfer section")
    ap.add_argument("--ports", default="8301,8302", help="the two instances' ports")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if args.ckpt is None and not cpu:
        ap.error("--ckpt is needed on cuda (make one with pdserve make-checkpoint)")
    if cpu and args.transport == "cuda_ipc":
        ap.error("--device cpu: cuda_ipc needs a GPU (give --transport tcp)")
    # cpu: the tiny model's sizes (prompt, batches, transfer lengths)
    prompt_len, batches, ctx, lens = (32, (1, 2), 24, [16, 64]) if cpu else (
        1024, (1, 16, 64), 1024, [1024, 16384, 65536])  # fmt: skip
    ports = tuple(int(p) for p in args.ports.split(","))
    assert len(ports) == 2, "--ports: two ports"
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            from pdserve.testing.checkpoint import make_checkpoint

            args.ckpt = str(make_checkpoint("LlamaForCausalLM", "tiny", tmp, dtype="float32"))
        VOCAB = 500 if cpu else 30000
        res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "gpu": "cpu" if cpu else torch.cuda.get_device_name()}  # fmt: skip
        ipc = dict(device=args.device, transport=args.transport, ports=ports)
        if args.only_ipc:
            res["ipc_transfer"] = ipc_transfer(
                args.ckpt, args.copy_bw, lens, Path(args.out).parent, **ipc
            )
            Path(args.out).write_text(json.dumps(res, indent=2))
            return 0
        return run(args, res, ipc, prompt_len, batches, ctx, lens)


def run(args, res, ipc, prompt_len, batches, ctx, lens) -> int:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    llm = make_engine(args.ckpt, args.device)
    res["startup_s"] = time.perf_counter() - t0
    res["warmup_phases"] = llm.engine.warmup_phases
    res["first_request"] = first_request(llm, prompt_len)
    print(json.dumps(res["first_request"]), flush=True)
    res["decode_split"] = [decode_split(llm, b, ctx) for b in batches]
    print(json.dumps(res["decode_split"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    llm.engine.shutdown()
    del llm
    import gc

    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    log_dir = Path(args.out).parent
    try:
        res["ipc_transfer"] = ipc_transfer(args.ckpt, args.copy_bw, lens, log_dir, **ipc)
    except Exception as e:
        res["ipc_transfer_error"] = f"{type(e).__name__}: {e}"
        print("ipc transfer failed:", res["ipc_transfer_error"], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
