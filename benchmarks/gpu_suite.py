"""One-call GPU suite (issue 5): the engine against the physical limits of the card it runs on.

Run on the GPU machine (benchmarks/run_gpu.sh makes the checkpoint and calls this):

    python3 benchmarks/gpu_suite.py --ckpt /tmp/llama-8b --out $OUT/gpu_suite.json

Sections (``--sections``, comma separated; default all):
  limits      device-to-device copy bandwidth and bf16 matmul rate, measured now
  throughput  offline generation: 256 prompts x 512 in / 128 out, output tok/s
  decode      decode step time at several batch sizes and contexts vs the roofline
              (weight bytes + KV bytes read) / measured copy bandwidth
  prefill     one 8K prompt: tokens/s and achieved TFLOP/s vs the measured matmul rate;
              then prefill_curve: tokens/s by prompt length (--prefill-lens), short
              prompts packed into 8K-token steps as the scheduler packs them (the
              prefill curve `pdserve plan` reads)
  peer        the same decode and prefill workloads through transformers
  serve       pdserve serve + pdserve bench serve random 1024/128, 500 prompts at rate inf:
              output tok/s, mean TTFT/TPOT, graph share of decode steps, warm start,
              and the run's prefix-cache hits (random prompts from a checkpoint whose
              tokenizer has the model's full vocabulary share no prefix; a checkpoint
              made before 2026-12-01 had a 512-token tokenizer and 41% hits)
Prints a table last and writes every number to the JSON file.

``--device cpu`` runs every section's code on a tiny checkpoint (made in a temporary
folder when ``--ckpt`` is not given) at the sizes of :data:`CPU_SIZES`, in seconds: a
smoke run of the script itself (tests/bench/test_gpu_suite.py), whose numbers mean
nothing. Its decode graphs are whatever the engine has on the CPU (none; the test stands
CUDA graphs in, so the graph-replay timing runs too).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.profiling.kernel_compiles import compiled_variants, new_variants  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """The workloads of one run: the H200's, or the CPU smoke run's (``--device cpu``).
    ``--batches``, ``--contexts``, ``--prefill-lens`` and ``--serve-starts`` override
    theirs."""

    dtype: str
    copy_elements: int  # limits: bf16 elements per copied buffer (1 Gi: 2 GiB)
    matmul_m: int  # limits: an m x m x m bf16 matmul
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    throughput: tuple[int, int, int]  # prompts, input tokens, output tokens
    batches: str
    contexts: str
    profile: str  # decode points profiled, "BxCTX,..."
    prefill_len: int
    prefill_lens: str
    peer_batches: tuple[int, ...]
    peer_ctx: int
    peer_prefill_len: int
    serve: tuple[int, int, int, int]  # prompts, input tokens, output tokens, max_model_len
    serve_starts: int


GPU_SIZES = Sizes(
    dtype="bfloat16", copy_elements=1 << 30, matmul_m=8192, max_model_len=20480,
    max_num_batched_tokens=8192, max_num_seqs=256, throughput=(256, 512, 128),
    batches="1,16,64,256", contexts="1024,16384", profile="1x1024,16x1024,64x1024",
    prefill_len=8192, prefill_lens="1024,4096,8192,16384", peer_batches=(1, 16, 64),
    peer_ctx=1024, peer_prefill_len=8192, serve=(500, 1024, 128, 4096), serve_starts=3,
)  # fmt: skip
CPU_SIZES = Sizes(
    dtype="float32", copy_elements=1 << 20, matmul_m=128, max_model_len=160,
    max_num_batched_tokens=64, max_num_seqs=4, throughput=(4, 16, 4), batches="1,2",
    contexts="24,40", profile="2x24", prefill_len=64, prefill_lens="16,64",
    peer_batches=(1, 2), peer_ctx=24, peer_prefill_len=64, serve=(4, 16, 4, 128), serve_starts=1,
)  # fmt: skip


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], object], dev: torch.device) -> float:
    """Seconds of one ``fn()``: CUDA events on a GPU, the host clock on a CPU."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize(dev)
    return s.elapsed_time(e) / 1e3


def _device(llm: LLM) -> torch.device:
    return llm.engine.runner.device


def _ids(llm: LLM, g: torch.Generator, n: int) -> list[int]:
    """``n`` random token ids the model's vocabulary holds."""
    return torch.randint(10, min(30000, llm.engine.vocab_size), (n,), generator=g).tolist()


def measure_limits(device: str = "cuda", sizes: Sizes = GPU_SIZES) -> dict:
    dev = torch.device(device)
    src = torch.randn(sizes.copy_elements, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(dev)
    times = [_timed(lambda d=dst, s=src: d.copy_(s), dev) for _ in range(10)]
    bw = 2 * src.numel() * 2 / statistics.median(times)  # bytes read + written
    del src, dst
    m = sizes.matmul_m
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        a @ b
    _sync(dev)
    times = [_timed(lambda x=a, y=b: x @ y, dev) for _ in range(10)]
    flops = 2 * m**3 / statistics.median(times)
    del a, b
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bandwidth_Bps": bw, "bf16_matmul_flops": flops}


def fp8_matmul_flops(device: str = "cuda", m: int = 8192) -> float:
    """FLOP/s of ``torch._scaled_mm`` on ``m``^3 float8_e4m3fn operands with per-tensor
    scales: the fp8 matmul rate the FP8 benchmarks compare against (raises where this
    PyTorch or GPU has no fp8 matmul)."""
    dev = torch.device(device)
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    _sync(dev)
    times = [_timed(mm, dev) for _ in range(10)]
    return 2 * m**3 / statistics.median(times)


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights a decode step reads: every parameter but an untied input
    embedding table, of which a step gathers only its batch's rows (1.05 GB of the
    16.06 GB of llama-8b-shape; runs before 2026-11-29 run 7 counted it)."""
    model = llm.engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if embed is not None and (head is None or head.weight is not embed.weight):
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    return int(llm.engine.runner.kv_cache_config.bytes_per_token)


def _add(llm: LLM, rid: str, ids: list[int], max_tokens: int) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = llm.processor.make_request(rid, ids, sp)
    llm.engine.add_request(req)


def _drain(llm: LLM) -> None:
    eng = llm.engine
    eng.abort_requests(list(eng.scheduler.requests))
    eng.set_async_scheduling(False)  # finishes a step left in flight
    eng.step()


def offline_workload(
    llm: LLM, num: int, inp: int, out: int, seed: int = 0
) -> tuple[list[dict], SamplingParams]:
    """``num`` random prompts of ``inp`` tokens, each to generate ``out`` (greedy, no EOS)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": _ids(llm, g, inp)} for _ in range(num)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)


def bench_throughput(llm: LLM, num: int = 256, inp: int = 512, out: int = 128) -> dict:
    prompts, sp = offline_workload(llm, num, inp, out)
    llm.generate(
        prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )  # warm-up
    _sync(_device(llm))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": num,
        "input_len": inp,
        "output_len": out,
        "seconds": dt,
        "output_tok_s": ntok / dt,
        "total_tok_s": (ntok + num * inp) / dt,
    }


def bench_decode(
    llm: LLM,
    batch: int,
    ctx: int,
    limits: dict,
    steps: int = 20,
    profile: bool = False,
    async_scheduling: bool = False,
) -> dict:
    """Median decode step at ``batch`` x ``ctx``. With ``async_scheduling`` the engine
    keeps one step in flight, so a step's time is the period between steps."""
    eng = llm.engine
    # Prompts are prefilled a token budget at a time, and the ones done first decode
    # while the rest prefill: leave every request enough tokens that none finishes
    # before the timed and profiled steps are over (runs before 2026-11-29 run 9 gave
    # steps + 8, so at 256 x 1K and 16 x 16K the batch had shrunk when it was timed).
    prefill_steps = -(-batch * ctx // eng.config.scheduler.max_num_batched_tokens) + 1
    max_tokens = prefill_steps + 3 + steps + 8
    need_blocks = batch * (-(-(ctx + max_tokens) // eng.kv.block_size))
    if need_blocks > eng.kv.pool.num_usable_blocks or ctx + max_tokens > eng.max_model_len:
        return {
            "batch": batch,
            "ctx": ctx,
            "skipped": f"needs {need_blocks} KV blocks, {eng.kv.pool.num_usable_blocks} available",
        }
    g = torch.Generator().manual_seed(batch * 7 + ctx)
    for i in range(batch):
        _add(llm, f"d{batch}-{ctx}-{i}", _ids(llm, g, ctx), max_tokens)
    # prefill everything, then run a few decode steps as warm-up
    while eng.scheduler.waiting or any(
        not r.output_token_ids for r in eng.scheduler.requests.values()
    ):
        eng.step()
    eng.set_async_scheduling(async_scheduling)
    for _ in range(3):
        eng.step()
    _sync(_device(llm))
    compiled0 = compiled_variants()
    times, sizes = [], []
    for _ in range(steps):
        sizes.append(len(eng.scheduler.running))
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    replay = None if async_scheduling else graph_replay_ms(llm)
    kernels = profile_steps(llm) if profile and not async_scheduling else None
    _drain(llm)
    step = statistics.median(times)
    kv = batch * (ctx + prefill_steps // 2 + 3 + steps // 2) * kv_bytes_per_token(llm)
    roof = (weight_bytes(llm) + kv) / limits["copy_bandwidth_Bps"]
    out = {
        "batch": batch,
        "ctx": ctx,
        "step_ms": step * 1e3,
        "roofline_ms": roof * 1e3,
        "ratio": step / roof,
        "tok_s": batch / step,
        "graph_replay_ms": replay,
        "running_during_timing": [min(sizes), max(sizes)],  # must be [batch, batch]
        # Triton variants compiled while timed (each a stall): must be none
        "kernel_compiles": new_variants(compiled0, compiled_variants()),
        "async_scheduling": async_scheduling,
    }
    if kernels is not None:
        out["kernels"] = kernels
    return out


def graph_replay_ms(llm: LLM, reps: int = 15) -> float | None:
    """Device time of the replay alone (no host prep, no sampling) of the graph the
    engine's last step replayed, over that step's inputs: its key is (padded batch, query
    length, context width), as the runner recorded it. None when the step ran eagerly."""
    runner = llm.engine.runner
    key = runner._graph_key  # the graph the last step replayed
    if runner.graphs is None or key is None:
        return None
    graphs, dev = runner.graphs, _device(llm)
    return statistics.median(_timed(lambda: graphs.replay(*key), dev) for _ in range(reps)) * 1e3


def profile_steps(llm: LLM, steps: int = 5) -> dict:
    """Per-step device time by kernel (top 12) over ``steps`` engine steps, from the
    CUDA profiler: where the step's device time goes (on a CPU: operators' own time).
    A kernel launched early by programmatic dependent launch counts from its
    predecessor's end (``step_profile.clip_waits``); ``pdl_wait_ms_per_step`` is the
    waiting left out."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.profiling.step_profile import spans_from_events

    dev = _device(llm)
    cuda = dev.type == "cuda"
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
        _sync(dev)
    totals: dict[str, list[float]] = {}  # name (cut to 90 characters): [us, calls]

    def add(name: str, us: float, calls: int) -> None:
        row = totals.setdefault(name[:90], [0.0, 0.0])
        row[0] += us
        row[1] += calls

    waited = 0.0
    if cuda:
        for sp in spans_from_events(prof.events(), "cuda"):
            add(sp.name, sp.busy_us, 1)
            waited += sp.end_us - sp.start_us - sp.busy_us
    else:  # on a CPU: each operator's own time (its children's are theirs)
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                add(e.key, e.self_cpu_time_total, e.count)
    rows = sorted(((n, t / steps / 1e3, c / steps) for n, (t, c) in totals.items()),
                  key=lambda r: -r[1])  # fmt: skip
    return {
        "kernel_ms_per_step": sum(r[1] for r in rows),
        "kernels_per_step": sum(r[2] for r in rows),
        "pdl_wait_ms_per_step": waited / steps / 1e3,
        "top": [{"name": n, "ms": t, "calls": c} for n, t, c in rows[:12]],
    }


def bench_prefill(llm: LLM, limits: dict, n: int = 8192) -> dict:
    eng = llm.engine
    if n > eng.config.scheduler.max_num_batched_tokens or n >= eng.max_model_len:
        return {"skipped": "max_num_batched_tokens or max_model_len below the prompt"}
    g = torch.Generator().manual_seed(1)
    times = []
    dev = _device(llm)
    for i in range(4):
        _add(llm, f"p{i}", _ids(llm, g, n), 1)
        _sync(dev)
        t0 = time.perf_counter()
        eng.step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        _drain(llm)
    t = statistics.median(times[1:])
    hc = eng.runner.hf_config
    params = sum(p.numel() for p in eng.runner.model.parameters()) - hc.vocab_size * hc.hidden_size
    flops = 2 * params * n + 2 * hc.num_hidden_layers * hc.num_attention_heads * hc.head_dim * n * n
    return {
        "tokens": n,
        "seconds": t,
        "tok_s": n / t,
        "tflops": flops / t / 1e12,
        "share_of_matmul_peak": flops / t / limits["bf16_matmul_flops"],
    }


def bench_prefill_curve(llm: LLM, lens: list[int]) -> list[dict]:
    """Prefill throughput by prompt length as a serving engine sees it: prompts no longer
    than the step budget (``max_num_batched_tokens``) are packed ``budget // L`` to a step
    (as the scheduler packs a queue of short prompts); longer ones are chunked over several
    steps. Each point is the median of 3 timed rounds after one untimed round; ``pdserve
    plan`` reads the list."""
    eng = llm.engine
    budget = eng.config.scheduler.max_num_batched_tokens
    dev = _device(llm)
    g = torch.Generator().manual_seed(2)
    out = []
    for n in lens:
        if n >= eng.max_model_len:
            out.append({"tokens": n, "skipped": "max_model_len below the prompt"})
            continue
        k = max(1, budget // n)
        times, steps = [], 0
        for rnd in range(4):
            for i in range(k):
                _add(llm, f"c{n}-{rnd}-{i}", _ids(llm, g, n), 1)
            _sync(dev)
            t0 = time.perf_counter()
            steps = 0
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            _sync(dev)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        out.append({"tokens": n, "prompts_per_round": k, "steps_per_round": steps,
                    "seconds_per_prompt": t / k, "tok_s": n * k / t})  # fmt: skip
    return out


def bench_peer(ckpt: str, limits: dict, device: str = "cuda", sizes: Sizes = GPU_SIZES) -> dict:
    """The same decode and prefill workloads through transformers (the side-by-side peer)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    dtype = getattr(torch, sizes.dtype)
    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="sdpa")
    m = m.to(dev).eval()
    ctx, vocab = sizes.peer_ctx, min(30000, m.config.vocab_size)
    wbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    hc = m.config
    kv_tok = (
        2
        * hc.num_hidden_layers
        * hc.num_key_value_heads
        * (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
        * dtype.itemsize
    )
    out: dict = {"decode": []}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in sizes.peer_batches:
            ids = torch.randint(10, vocab, (b, ctx), generator=g).to(dev)
            o = m(ids, use_cache=True, logits_to_keep=1)
            past = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for i in range(13):
                _sync(dev)
                t0 = time.perf_counter()
                o = m(nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                _sync(dev)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
                past = o.past_key_values
            step = statistics.median(times)
            roof = (wbytes + b * (ctx + 8) * kv_tok) / limits["copy_bandwidth_Bps"]
            out["decode"].append(
                {"batch": b, "ctx": ctx, "step_ms": step * 1e3, "ratio": step / roof}
            )
            print(json.dumps(out["decode"][-1]), flush=True)
            del past, o
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        n = sizes.peer_prefill_len
        ids = torch.randint(10, vocab, (1, n), generator=g).to(dev)
        times = []
        for _ in range(4):
            _sync(dev)
            t0 = time.perf_counter()
            m(ids, use_cache=False, logits_to_keep=1)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        out["prefill"] = {"tokens": n, "tok_s": n / t, "seconds": t}
        print(json.dumps(out["prefill"]), flush=True)
    del m
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_serve(
    ckpt: str,
    log_dir: Path,
    port: int = 8011,
    *,
    device: str = "0",
    sizes: Sizes = GPU_SIZES,
    starts: int = 3,
    extra_args: tuple[str, ...] = (),
) -> dict:
    """`pdserve serve` (on GPU ``device``, or "cpu") + `pdserve bench serve` random
    1024/128 (``sizes.serve``): warm start (the first request after each of ``starts``
    fresh server starts, against the median of 8 one at a time on the last), then 500
    prompts at rate inf, and the forward-path counts from the server's /metrics (the
    graph share of decode steps).

    One first request per start is a single sample with the host's noise (+-10 ms on a
    ~40 ms TTFT in run 21), so its median over several starts is what the target is
    judged on; every sample is kept."""
    import httpx

    from pdserve.bench.serve import run_benchmark
    from pdserve.serving.launch.launcher import Launcher
    from pdserve.serving.launch.topology import Topology

    num_prompts, input_len, output_len, max_model_len = sizes.serve
    serve_args = ["--dtype", sizes.dtype, "--max-model-len", str(max_model_len), *extra_args]
    topo = Topology.from_dict(
        {
            "model": ckpt,
            "served_model_name": "m",
            "common_args": [*serve_args, "--uvicorn-log-level", "warning"],
            "startup_timeout": 300,
            "instances": [{"role": "colocated", "port": port, "devices": device}],
        }
    )
    url = f"http://127.0.0.1:{port}"
    common = dict(
        base_url=url,
        model="m",
        tokenizer=ckpt,
        dataset_name="random",
        random_input_len=input_len,
        random_output_len=output_len,
        disable_tqdm=True,
    )

    def ttft(r0: dict, name: str) -> dict:
        if not r0["completed"]:
            raise RuntimeError(f"{name} warm-start requests failed: {r0.get('errors')}")
        return r0

    out: dict = {"ready_s": [], "first_ttft_ms_each": [], "num_prompts": num_prompts,
                 "input_len": input_len, "output_len": output_len}  # fmt: skip
    for i in range(starts):
        t0 = time.perf_counter()
        with Launcher(topo, log_dir=log_dir / f"serve_{i}"):
            out["ready_s"].append(time.perf_counter() - t0)
            first = ttft(run_benchmark(num_prompts=1, seed=11, **common), "first")
            out["first_ttft_ms_each"].append(first["mean_ttft_ms"])
            if i < starts - 1:
                continue
            steady = ttft(
                run_benchmark(num_prompts=8, max_concurrency=1, seed=12, **common), "steady"
            )
            out["first_ttft_ms"] = statistics.median(out["first_ttft_ms_each"])
            out["steady_ttft_ms"] = steady["median_ttft_ms"]
            out["first_over_steady"] = out["first_ttft_ms"] / steady["median_ttft_ms"]
            before = _prefix_counters(url)
            r = run_benchmark(
                num_prompts=num_prompts,
                request_rate=float("inf"),
                seed=13,
                percentile_metrics="ttft,tpot,itl,e2el",
                metric_percentiles="90",
                **common,
            )
            keys = ("completed", "output_throughput", "mean_ttft_ms", "p90_ttft_ms")
            out.update({k: r[k] for k in (*keys, "mean_tpot_ms", "p90_tpot_ms")})
            after = _prefix_counters(url)  # how much of the run was prefix-cache hits
            queries = after["queries"] - before["queries"]
            out["prefix_cache"] = {
                "queries": queries,
                "hits": after["hits"] - before["hits"],
                "hit_rate": (after["hits"] - before["hits"]) / queries if queries else None,
            }
            paths = {}
            for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
                if line.startswith("pdserve:forward_steps_total{"):
                    paths[line.split('path="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
            out["forward_steps"] = paths
            decode = paths.get("graph", 0.0) + paths.get("eager:no_graph_for_shape", 0.0)
            out["graph_share_of_decode_steps"] = (
                paths.get("graph", 0.0) / decode if decode else None
            )
    return out


def _prefix_counters(url: str) -> dict[str, float]:
    """The server's prefix-cache token counters (summed over engines)."""
    import httpx

    out = {"queries": 0.0, "hits": 0.0}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        for key in out:
            if line.startswith(f"pdserve:prefix_cache_{key}_total"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


SECTIONS = ("limits", "peer", "serve", "throughput", "decode", "prefill")


def make_engine(ckpt: str, args: argparse.Namespace, sizes: Sizes) -> tuple[LLM, str | None]:
    """The in-process engine of the throughput, decode and prefill sections, and the
    error of a first start that failed (then it started eagerly)."""
    kwargs: dict = dict(
        dtype=sizes.dtype,
        max_model_len=sizes.max_model_len,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_num_seqs=sizes.max_num_seqs,
        attention_backend=args.attention_backend,
    )
    if args.device == "cpu":
        kwargs["device"] = "cpu"
    else:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    try:
        return LLM(ckpt, **kwargs), None
    except Exception as e:  # keep the call useful: fall back to eager and say so
        err = f"{type(e).__name__}: {e}"
        print("engine start failed, retrying eagerly:", err, flush=True)
        return LLM(ckpt, enforce_eager=True, **kwargs), err


def _points(spec: str) -> set[tuple[int, int]]:
    """Decode points, "BxCTX,...", as {(B, CTX)}."""
    return {(int(b), int(c)) for b, c in (p.split("x") for p in spec.split(",") if p)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint folder (required on cuda; cpu: a tiny one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--batches", help="decode batch sizes (default: the device's sizes)")
    ap.add_argument("--contexts", help="decode contexts (default: the device's sizes)")
    ap.add_argument("--prefill-lens", help="prompt lengths of prefill_curve")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument(
        "--attention-backend", default="auto", help="the engine's (auto: what a user gets)"
    )
    ap.add_argument("--serve-starts", type=int, help="server starts for the warm-start median")
    ap.add_argument("--serve-port", type=int, default=8011)
    ap.add_argument(
        "--serve-args", default="", help='extra `pdserve serve` flags, e.g. "--async-scheduling"'
    )
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(sections - set(SECTIONS))} ({', '.join(SECTIONS)})")
    cpu = args.device == "cpu"
    if args.ckpt is None and not cpu:
        ap.error("--ckpt is needed on cuda (make one with pdserve make-checkpoint)")
    sizes = CPU_SIZES if cpu else GPU_SIZES
    threads = torch.get_num_threads()
    if cpu:  # a smoke run: two-thread ops stall for milliseconds on a shared CPU
        torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.ckpt is None:
                from pdserve.testing.checkpoint import make_checkpoint

                ckpt = make_checkpoint("LlamaForCausalLM", "tiny", tmp, dtype="float32")
                args.ckpt = str(ckpt)
            return run(args, sections, sizes)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace, sections: set[str], sizes: Sizes) -> int:
    cpu = args.device == "cpu"
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fused_kernels": os.environ.get("PDSERVE_FUSED_KERNELS", "auto"),
        "serve_args": args.serve_args,
    }
    try:  # PDSERVE_COMMIT: the device's copy of the tree may carry a stale .git
        res["commit"] = (
            os.environ.get("PDSERVE_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
        )
    except OSError:
        res["commit"] = "unknown"
    res["limits"] = measure_limits(args.device, sizes)  # every section's yardstick
    print(json.dumps(res["limits"]), flush=True)
    if "peer" in sections:  # first, while the card is empty
        res["peer"] = bench_peer(args.ckpt, res["limits"], args.device, sizes)
    if "serve" in sections:  # a server process of its own, also before the in-process engine
        try:
            res["serve"] = bench_serve(
                args.ckpt,
                Path(args.out).parent,
                args.serve_port,
                device="cpu" if cpu else "0",
                sizes=sizes,
                starts=args.serve_starts or sizes.serve_starts,
                extra_args=tuple(args.serve_args.split()),
            )
        except Exception as e:
            res["serve_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(res.get("serve")), flush=True)
    t0 = time.perf_counter()
    llm, err = make_engine(args.ckpt, args, sizes)
    if err is not None:
        res["engine_error"] = err
    res["engine_startup_s"] = time.perf_counter() - t0
    res["warmup_phases"] = llm.engine.warmup_phases
    res["num_kv_blocks"] = llm.engine.kv.pool.num_blocks
    res["weight_bytes"] = weight_bytes(llm)
    res["attention_backend"] = ",".join(
        sorted({b.name for b in llm.engine.runner.step.backends.values()})
    )
    res["cudagraph_mode"] = llm.engine.runner.graph_mode()

    def section(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            res[name] = fn()
        except Exception as e:
            res[name + "_error"] = f"{type(e).__name__}: {e}"
            print(name, "failed:", res[name + "_error"], flush=True)
            _drain(llm)
        Path(args.out).write_text(json.dumps(res, indent=2))  # partial results survive a kill

    if "throughput" in sections:
        section("throughput", lambda: bench_throughput(llm, *sizes.throughput))
        print(json.dumps(res.get("throughput")), flush=True)
    if "decode" in sections:
        profiled = _points(sizes.profile)

        def decode_all() -> list:
            out = []
            for ctx in map(int, (args.contexts or sizes.contexts).split(",")):
                for b in map(int, (args.batches or sizes.batches).split(",")):
                    prof = (b, ctx) in profiled
                    r = bench_decode(llm, b, ctx, res["limits"], profile=prof)
                    print(json.dumps(r), flush=True)
                    out.append(r)
                    if "step_ms" in r:  # the same point with one step in flight
                        ra = bench_decode(llm, b, ctx, res["limits"], async_scheduling=True)
                        print(json.dumps(ra), flush=True)
                        r["async_step_ms"] = ra.get("step_ms")
                        r["async_ratio"] = ra.get("ratio")
            return out

        section("decode", decode_all)
    if "prefill" in sections:
        section("prefill", lambda: bench_prefill(llm, res["limits"], sizes.prefill_len))
        print(json.dumps(res.get("prefill")), flush=True)
        lens = [int(x) for x in (args.prefill_lens or sizes.prefill_lens).split(",") if x]
        section("prefill_curve", lambda: bench_prefill_curve(llm, lens))
        print(json.dumps(res.get("prefill_curve")), flush=True)
    res["step_paths"] = dict(llm.engine.stats().step_paths)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print_table(res)
    return 0


def print_table(res: dict) -> None:
    lim = res["limits"]
    print(
        f"\n== {res['gpu']} | torch {res['torch']} | commit {res['commit']} | {res['date']}"
        f" | fused kernels {res.get('fused_kernels')}"
    )
    print(
        f"attention {res.get('attention_backend')} | cudagraph_mode {res.get('cudagraph_mode')} | "
        f"warm-up {res.get('warmup_phases')} | step paths {res.get('step_paths')}"
    )
    for k, v in res.items():
        if k.endswith("_error"):
            print(f"ERROR {k}: {v}")
    print(
        f"copy bandwidth {lim['copy_bandwidth_Bps'] / 1e12:.2f} TB/s | bf16 matmul {lim['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
        f" | weights {res['weight_bytes'] / 1e9:.2f} GB | KV blocks {res['num_kv_blocks']} | start-up {res['engine_startup_s']:.1f}s"
    )
    if res.get("throughput"):
        t = res["throughput"]
        print(
            f"throughput {t['num_prompts']}x{t['input_len']}/{t['output_len']}: {t['output_tok_s']:.0f} output tok/s"
            f" ({t['total_tok_s']:.0f} total tok/s, {t['seconds']:.1f}s)"
        )
    if res.get("decode"):
        print(
            f"{'batch':>6} {'ctx':>6} {'step ms':>9} {'roof ms':>9} {'ratio':>6} {'tok/s':>8} {'replay ms':>10}"
            f" {'async ms':>9} {'ratio':>6}"
        )
        for r in res["decode"]:
            if "skipped" in r:
                print(f"{r['batch']:>6} {r['ctx']:>6}  skipped: {r['skipped']}")
            else:
                rp = r.get("graph_replay_ms")
                print(
                    f"{r['batch']:>6} {r['ctx']:>6} {r['step_ms']:>9.2f} {r['roofline_ms']:>9.2f} {r['ratio']:>6.2f} {r['tok_s']:>8.0f}"
                    f" {rp if rp is None else round(rp, 2)!s:>10}"
                    f" {r.get('async_step_ms') or 0:>9.2f} {r.get('async_ratio') or 0:>6.2f}"
                )
                ran = r.get("running_during_timing")
                if ran and ran != [r["batch"], r["batch"]]:
                    print(f"{'':>6} {'':>6} WARNING: {ran[0]}..{ran[1]} requests ran while timed")
                if r.get("kernel_compiles"):
                    print(f"{'':>6} {'':>6} WARNING: compiled {sorted(r['kernel_compiles'])} while timed")
        for r in res["decode"]:
            k = r.get("kernels")
            if k:
                print(
                    f"batch {r['batch']} ctx {r['ctx']}: {k['kernel_ms_per_step']:.2f} ms of kernels in "
                    f"{k['kernels_per_step']:.0f} launches per step; top:"
                )
                for t in k["top"]:
                    print(f"    {t['ms']:7.3f} ms {t['calls']:6.0f}x  {t['name']}")
    if "peer" in res:
        pd = {(r["batch"], r["ctx"]): r for r in res.get("decode", []) if "step_ms" in r}
        for r in res["peer"]["decode"]:
            ours = pd.get((r["batch"], r["ctx"]))
            vs = (
                f" | pdserve {ours['step_ms']:.2f} ms ({r['step_ms'] / ours['step_ms']:.2f}x faster)"
                if ours
                else ""
            )
            print(
                f"transformers decode batch {r['batch']} ctx {r['ctx']}: {r['step_ms']:.2f} ms "
                f"({r['ratio']:.2f}x roofline){vs}"
            )
        print(
            f"transformers prefill {res['peer']['prefill']['tokens']}: {res['peer']['prefill']['tok_s']:.0f} tok/s"
        )
    if res.get("serve"):
        sv = res["serve"]
        print(
            f"serve {sv['num_prompts']} x {sv['input_len']}/{sv['output_len']} rate inf: "
            f"{sv['output_throughput']:.0f} output tok/s, mean TTFT "
            f"{sv['mean_ttft_ms']:.0f} ms (p90 {sv['p90_ttft_ms']:.0f}), mean TPOT {sv['mean_tpot_ms']:.1f} ms "
            f"(p90 {sv['p90_tpot_ms']:.1f}); graph share of decode steps {sv['graph_share_of_decode_steps']}; "
            f"prefix-cache hits {sv['prefix_cache']['hits']:.0f} of {sv['prefix_cache']['queries']:.0f} prompt tokens"
        )
        print(
            f"warm start: first request TTFT {sv['first_ttft_ms']:.0f} ms vs steady {sv['steady_ttft_ms']:.0f} ms"
            f" ({sv['first_over_steady']:.2f}x; median of the first request after each of "
            f"{len(sv['first_ttft_ms_each'])} starts: "
            f"{', '.join(f'{t:.0f}' for t in sv['first_ttft_ms_each'])} ms); server ready in "
            f"{', '.join(f'{t:.1f}' for t in sv['ready_s'])} s"
        )
    if "prefill" in res and "tok_s" in res["prefill"]:
        p = res["prefill"]
        print(
            f"prefill {p['tokens']} tokens: {p['tok_s']:.0f} tok/s, {p['tflops']:.0f} TFLOP/s = {p['share_of_matmul_peak']:.0%} of matmul peak"
        )


if __name__ == "__main__":
    sys.exit(main())
