"""KV transfer time per transport next to the copy bound, and 1P1D equality over nixl.

Part 1 (transfer): a spawned "prefill" process holds a KV cache of Llama-3-8B geometry
(32 layers, 8 KV heads, head_dim 128, bf16, blocks of 16 tokens) filled at random, and
serves it over each transport's real KV server (authenticated side channel, leases).
This process is "decode": for each prompt length it reads one leased request's blocks
into its own cache through a handshaken ``PeerLink`` and times

- ``transfer``: what a request waits for, as the engine's puller does it
  (``PeerLink.start_read`` with the block ids prefill's params named, until the bytes
  have landed; ``pdserve:kv_transfer_time_seconds`` measures the same span). cuda_ipc
  and nixl read prefill's memory themselves, so their copy starts before the read's
  reply and overlaps its round trip; ``early`` says whether it did in every timed read
  (``PeerLink.copied_early``; before session 27 the bench named other ids than prefill's
  lease held, so every copy waited for the reply and the column only said the transport
  could); tcp needs the reply's frames;
- ``rtt`` + ``copy`` = ``sequential``: the read's round trip, then the transport's
  write alone (cuda_ipc: one kernel launch; nixl: one READ), in another read of the
  same length (the path without the overlap);
- ``done``: the done notice's round trip, after the request has its KV (off its path);
- ``bound``: a device-to-device copy of the same bytes, measured here in the same call
  (with ``--prefill-device`` on another GPU: a peer copy from that GPU to this one).

Each point is the median of ``--reps`` reads after one warm-up read per transport (the
handshake, mapping and kernel compile). The copied blocks are checked against prefill's.
``copy`` is host time (the launch, the copy, the wake-up); over cuda_ipc ``kernel`` is
the copy alone on the GPU (timing events around the ids' upload and the kernel), and
the early read's timeline is printed: when the launch returned, the reply arrived, the
copy ran on the GPU (events placed on the host clock by one completed just before),
and the bytes landed. ``--variants`` measures the early copy's orders side by side
(``before``: launched, then the read sent, as session 11 did; ``after``: sent, then
launched, and the launch flushed to the GPU by a query of its event, as now), and
``--copy-shapes`` times the block-copy kernel alone for launch shapes (bytes a loop
step, warps a program), e.g. on the H200 (under a minute)::

    python3 benchmarks/transfer_bench.py --transports cuda_ipc --no-equality \
        --variants before,send,flush,after --copy-shapes 8192:4,16384:4,16384:8,32768:8 \
        --out $OUT/transfer_variants.json

Part 2 (equality, unless ``--no-equality``): a prefill engine (spawned) and a decode
engine (here) on ``transport: nixl`` (``--equality-transport``; nixl's runs only where
nixl imports) serve greedy requests; the tokens must equal a colocated engine's. A tiny
random Llama checkpoint is made unless ``--ckpt`` is given.

    # H200 (about 1-2 minutes):
    python3 benchmarks/transfer_bench.py --out $OUT/transfer.json
    # two GPUs of one host (prefill on cuda:1, decode here on cuda:0):
    python3 benchmarks/transfer_bench.py --device cuda:0 --prefill-device cuda:1 \
        --transports cuda_ipc,tcp --no-equality --out $OUT/transfer_x2.json
    # CPU smoke run (tcp, and nixl where it imports; small geometry):
    python3 benchmarks/transfer_bench.py --device cpu --layers 2 --lens 64,256 \\
        --transports tcp,nixl --out /tmp/transfer.json
    # the same with the equality part over tcp (tests/bench/test_bench_scripts.py):
    python3 benchmarks/transfer_bench.py --device cpu --layers 2 --heads 2 --head-dim 16 \\
        --lens 64,256 --reps 2 --transports tcp --equality-transport tcp --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from pdserve.core_types.cache_spec import CacheLayout, KVCacheConfig  # noqa: E402
from pdserve.core_types.kv_connector import KVPeer  # noqa: E402
from pdserve.core_types.pd_auth import SECRET_ENV, new_secret  # noqa: E402
from pdserve.forward_context import KVCaches  # noqa: E402
from pdserve.kv_transfer import wire as W  # noqa: E402

SECRET = b"transfer-bench-secret-0123456789abcdef"
COMPAT = {"bench": 1}
BLOCK = 16


def cache_config(layers: int, heads: int, head_dim: int) -> KVCacheConfig:
    lay = CacheLayout("gqa", "bfloat16", (2, 1, BLOCK, heads, head_dim), block_axis=1)
    return KVCacheConfig.from_layers(
        BLOCK, [(f"layers.{i}.attn", "attn", lay) for i in range(layers)]
    )


def held_blocks(length: int) -> list[int]:
    return list(range(1, 1 + -(-length // BLOCK)))


def open_spec(spec: str, caches: KVCaches):  # type: ignore[no-untyped-def]
    """``open_transport`` for a ``--transports`` entry: a transport's name (nixl with the
    serve default's UCX worker threads), or ``nixl:N`` for nixl with N (``nixl_threads``;
    ``nixl:0``: NIXL's single worker)."""
    from pdserve.kv_transfer.transports import open_transport

    name, _, threads = spec.partition(":")
    if not threads:
        return open_transport(name, caches)
    if name != "nixl":
        raise SystemExit(f"--transports {spec}: only nixl takes a thread count (nixl:N)")
    return open_transport(name, caches, nixl_threads=int(threads))


def prefill_side(args: argparse.Namespace, conn) -> None:  # type: ignore[no-untyped-def]
    """The prefill process: caches, one KV server per transport, leases for every read."""
    from pdserve.kv_transfer.handler import KVRequestHandler, ServerLimits
    from pdserve.kv_transfer.lease import LeaseTable
    from pdserve.kv_transfer.server import KVServer

    dev = torch.device(args.prefill_device)
    caches = KVCaches.allocate(
        cache_config(args.layers, args.heads, args.head_dim), args.blocks, dev
    )
    g = torch.Generator(device=dev).manual_seed(0)
    for _, _, c in caches.layers():
        c.normal_(generator=g)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ports, servers, transports = {}, [], []
    for name in args.transports.split(","):
        leases = LeaseTable(600.0, max_reads=1000)
        for v in args.variants:
            leases.add(f"{name}/{v}/warm", held_blocks(1024))
            leases.add(f"{name}/{v}/warm-seq", held_blocks(1024))
            for n in args.lens:
                for r in range(args.reps):
                    leases.add(f"{name}/{v}/{n}-{r}", held_blocks(n))
                    leases.add(f"{name}/{v}/{n}-{r}-seq", held_blocks(n))
        try:
            t = open_spec(name, caches)
            transports.append(t)
            limits = ServerLimits()
            handler = KVRequestHandler(
                SECRET, f"prefill-{name}", COMPAT, t.server(), leases, limits
            )
            srv = KVServer(handler, "127.0.0.1", 0)
        except Exception as e:  # report it, measure the others
            ports[name] = f"{type(e).__name__}: {e}"
            continue
        servers.append(srv)
        ports[name] = srv.port
    last = max(held_blocks(max(args.lens)))
    sample = {n: c.narrow(1, last, 1).cpu() for n, _, c in caches.layers()}
    conn.send((ports, sample))
    conn.recv()  # until the decode side is done
    for srv in servers:
        srv.close()
    for t in transports:
        t.close()


def _timed_copy_bound(nbytes: int, dev: torch.device, src: torch.device) -> float:
    """Seconds of one copy of ``nbytes`` from ``src`` to ``dev`` (best of 3)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = float("inf")
    for _ in range(3):
        if dev.type == "cuda":
            torch.cuda.synchronize(src)
            with torch.cuda.device(dev):  # timed on the destination's stream
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                b.copy_(a)
                e.record()
                e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
    del a, b
    return best


# --variants: (the early copy launched after the read is sent, the copy's event queried
# right after the launch); "before" is session 11's order (launch, then send; no query)
VARIANTS = {"before": (False, False), "send": (True, False), "flush": (False, True),
            "after": (True, True)}  # fmt: skip


def _measure(args, name, port, caches, sample, zctx, stop) -> list[dict]:  # type: ignore[no-untyped-def]
    """Per variant: a handshaken link, a warm-up read, then ``--reps`` timed reads of
    every length over transport ``name``."""
    from pdserve.kv_transfer.peer_link import PeerLink

    rows: list[dict] = []
    for variant in args.variants:
        t = open_spec(name, caches)
        link = PeerLink(zctx, SECRET, COMPAT, t.client, KVPeer("127.0.0.1", port), stop)
        try:
            link.handshake(30.0)
            link.send_first, flush = VARIANTS[variant]
            client = link.transport
            if hasattr(client, "flush_launch"):  # cuda_ipc's knobs
                client.flush_launch = flush  # type: ignore[union-attr]
                client.copy_step, client.copy_warps = args.copy_shape  # type: ignore[union-attr]
                client.trace = []  # type: ignore[union-attr]
            elif hasattr(client, "trace"):  # nixl: the host times of each read
                client.trace = []  # type: ignore[union-attr]
            rows += _reads(args, name, variant, link, caches, sample)
        finally:
            link.close()
            t.close()
    return rows


def _timeline(link, t0: float, anchor, anchor_at: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Milliseconds after ``t0`` of the early read's steps: the copy's launch returned,
    the reply arrived, the copy ran on the GPU (from timing events, placed on the host
    clock by ``anchor``, an event completed at ``anchor_at``); {} without a trace."""
    trace = getattr(link.transport, "trace", None)
    if not trace:
        return {}
    e = trace[-1]
    start, end = (anchor_at + anchor.elapsed_time(m) / 1e3 for m in e["events"])
    line = {
        "launched": (e["host_launched"] - t0) * 1e3,
        "launch_host": (e["host_launched"] - e["host_start"]) * 1e3,
        "reply": (link.replied_at - t0) * 1e3,
        "gpu_start": (start - t0) * 1e3,
        "gpu_end": (end - t0) * 1e3,
    }
    phases = e.get("host_phases") or []
    if len(phases) == 2:  # the launch's host time by part: ids checked, uploaded, the rest
        line["ids_host"] = (phases[0] - e["host_start"]) * 1e3
        line["upload_host"] = (phases[1] - phases[0]) * 1e3
        line["kernel_host"] = (e["host_launched"] - phases[1]) * 1e3
    return line


def _reads(args, name, variant, link, caches, sample) -> list[dict]:  # type: ignore[no-untyped-def]
    from pdserve.kv_transfer.peer_link import PeerLink

    dev = torch.device(args.device)
    cfg = caches.config
    rows: list[dict] = []
    stream = getattr(link.transport, "_stream", None) if dev.type == "cuda" else None

    def anchor():  # type: ignore[no-untyped-def]
        """A completed timing event on the copy's stream and the host time it completed."""
        if stream is None:
            return None, 0.0
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        ev.synchronize()
        return ev, time.perf_counter()

    def read(
        rid: str, held: list[int], link: PeerLink = link, name: str = name
    ) -> dict[str, float]:
        """One read of prefill's blocks ``held`` as the puller makes it (early copy where
        the transport can: the ids it expects are the ones the lease holds), then one of
        the same length in sequence (reply, then copy); seconds of each part, and
        ``early``: 1.0 if the first read's copy began before its reply."""
        rid = f"{variant}/{rid}"
        n = len(held)
        local = list(range(2, 2 + n))  # local: a real remap
        ev, at = anchor()
        t0 = time.perf_counter()
        link.start_read(W.Read(f"{name}/{rid}", 0, n, n), local, 60.0, held).wait()
        t1 = time.perf_counter()
        early_used = float(link.copied_early)
        line = _timeline(link, t0, ev, at) if ev is not None else {}
        link.notify(W.Done([f"{name}/{rid}"]), 10.0)
        t2 = time.perf_counter()
        reply, frames = link.request(W.Read(f"{name}/{rid}-seq", 0, n, n), 60.0)
        assert isinstance(reply, W.ReadReply), reply
        t3 = time.perf_counter()
        assert link.transport is not None
        link.transport.begin_write(reply.block_ids, local, frames, 60.0).wait()
        t4 = time.perf_counter()
        trace = getattr(link.transport, "trace", None)
        if trace and "events" in trace[-1]:  # the copy alone on the GPU (ids' upload, kernel)
            a, b = trace[-1]["events"]
            line["kernel"] = a.elapsed_time(b)
        elif trace and "host_landed" in trace[-1]:  # nixl: posting, then the wait (ms)
            e = trace[-1]
            line["post"] = (e["host_posted"] - e["host_start"]) * 1e3
            line["land"] = (e["host_landed"] - e["host_posted"]) * 1e3
        link.notify(W.Done([f"{name}/{rid}-seq"]), 10.0)
        got = {"transfer": t1 - t0, "done": t2 - t1, "rtt": t3 - t2, "copy": t4 - t3}
        return got | {k: v / 1e3 for k, v in line.items()} | {"early": early_used}

    read("warm", held_blocks(1024))
    for length in args.lens:
        held = held_blocks(length)  # what prefill's lease holds (prefill_side)
        n = len(held)
        got = [read(f"{length}-{r}", held) for r in range(args.reps)]
        nbytes = n * cfg.bytes_per_block
        bound = _timed_copy_bound(nbytes, dev, torch.device(args.prefill_device))
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        seq = statistics.median(g["rtt"] + g["copy"] for g in got)
        row = {
            "transport": name,
            "variant": variant,
            "prompt": length,
            "bytes": nbytes,
            # the early copy ran in every timed read (run 103 and before: never, the
            # expected ids were computed from a block count as if it were tokens)
            "early": all(g["early"] for g in got),
            "transfer_ms": med["transfer"] * 1e3,
            "copy_ms": med["copy"] * 1e3,
            "rtt_ms": med["rtt"] * 1e3,
            "sequential_ms": seq * 1e3,
            "done_ms": med["done"] * 1e3,
            "bound_ms": bound * 1e3,
            "copy_ratio": med["copy"] / bound,
            "transfer_ratio": med["transfer"] / bound,
        }
        for k in ("launched", "launch_host", "ids_host", "upload_host", "kernel_host", "reply",
                  "gpu_start", "gpu_end", "kernel", "post", "land"):  # fmt: skip
            if k in med:  # the early read's timeline (ms after it began), the kernel alone
                row[f"{k}_ms"] = med[k] * 1e3
        if "kernel" in med:
            row["kernel_ratio"] = med["kernel"] / bound
        rows.append(row)
    last = 2 + len(held_blocks(max(args.lens))) - 1
    for lname, _, c in caches.layers():  # the last read's last block arrived intact
        assert torch.equal(c.narrow(1, last, 1).cpu(), sample[lname]), (name, lname)
    return rows


def copy_shapes(args: argparse.Namespace) -> list[dict]:
    """The block-copy kernel alone (GPU time, CUDA events) for each ``--copy-shapes``
    launch shape, local caches to local caches of the bench's geometry (the ids remapped
    as the reads remap them), next to a device-to-device copy of the same bytes; each
    shape's copy is checked against the source blocks."""
    from pdserve.kv_transfer.transports.block_copy import CopyPlan, Segments, copy_blocks

    dev = torch.device(args.device)
    cfg = cache_config(args.layers, args.heads, args.head_dim)
    src = KVCaches.allocate(cfg, args.blocks, dev)
    dst = KVCaches.allocate(cfg, args.blocks, dev)
    for _, _, c in src.layers():
        c.normal_()
    plan = CopyPlan.make(Segments.of(src), Segments.of(dst), dev)
    stream = torch.cuda.Stream(dev)
    rows = []
    for length in args.lens:
        n = len(held_blocks(length))
        pairs = plan.block_pairs(held_blocks(length), list(range(2, 2 + n)))
        bound = _timed_copy_bound(n * cfg.bytes_per_block, dev, dev)
        for step, warps in args.copy_shapes:
            for _, _, c in dst.layers():
                c.zero_()
            # the zeroing (and the source's fill) ran on the default stream: the copy's
            # stream waits for it (run 69's last layer was checked against a copy that
            # the zeroing overwrote)
            stream.wait_stream(torch.cuda.current_stream(dev))
            times = []
            for _ in range(1 + args.reps):  # the first compiles
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                copy_blocks(plan, pairs, stream, step, warps)
                b.record(stream)
                b.synchronize()
                times.append(a.elapsed_time(b))
            for (lname, _, s_), (_, _, d_) in zip(src.layers(), dst.layers(), strict=True):
                assert torch.equal(d_.narrow(1, 2, n), s_.narrow(1, 1, n)), (lname, step)
            ms = statistics.median(times[1:])
            rows.append({"prompt": length, "step_bytes": step, "num_warps": warps,
                         "kernel_ms": ms, "bound_ms": bound * 1e3,
                         "ratio": ms / (bound * 1e3)})  # fmt: skip
    return rows


def _shape(text: str) -> tuple[int, int]:
    from pdserve.kernels.kv_block_copy import launch_shape

    step, _, warps = text.partition(":")
    return launch_shape(int(step), int(warps) if warps else None)


def transfers(args: argparse.Namespace) -> list[dict]:
    import zmq

    dev = torch.device(args.device)
    cfg = cache_config(args.layers, args.heads, args.head_dim)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_side, args=(args, child))
    proc.start()
    rows: list[dict] = []
    try:
        assert parent.poll(300), "the prefill process did not answer"
        ports, sample = parent.recv()
        caches = KVCaches.allocate(cfg, args.blocks, dev)
        zctx, stop = zmq.Context(), threading.Event()
        for name, port in ports.items():
            if isinstance(port, str):
                rows.append({"transport": name, "error": f"prefill side: {port}"})
                continue
            try:
                rows.extend(_measure(args, name, port, caches, sample, zctx, stop))
            except Exception as e:  # report it, measure the others
                rows.append({"transport": name, "error": f"{type(e).__name__}: {e}"})
            caches = KVCaches.allocate(cfg, args.blocks, dev)  # fresh zeros for the next
        zctx.destroy(linger=0)
    finally:
        parent.send("stop")
        proc.join(60)
    return rows


def _engine(ckpt: str, role: str | None, device: str, transport: str = "nixl"):  # type: ignore[no-untyped-def]
    from pdserve.config import EngineConfig
    from pdserve.engine.engine_core import EngineCore

    kw: dict = {"model": ckpt, "dtype": _dtype(device), "block_size": BLOCK, "device": device}
    kw["enforce_eager"] = True
    if device != "cpu":
        kw["gpu_memory_utilization"] = 0.15
    if role is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "PdConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": transport, "lease_seconds": 120},
        }
    return EngineCore(EngineConfig.from_kwargs(**kw))


def _dtype(device: str) -> str:
    """The equality part's engines' dtype: bf16 on a GPU, float32 on a CPU, where bf16
    matmuls of different batch shapes round differently often enough to flip a greedy
    near-tie between the plain engine and the 1P1D pair (the check is of the transfer)."""
    return "float32" if device == "cpu" else "bfloat16"


def _prompts() -> list[list[int]]:
    return [
        [(13 * i + 7 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((17, 100, 333, 1000))
    ]


def prefill_engine(ckpt: str, device: str, transport: str, conn) -> None:  # type: ignore[no-untyped-def]
    from pdserve import SamplingParams
    from pdserve.frontend.processor import InputProcessor
    from pdserve.frontend.tokenizer import Tokenizer

    core = _engine(ckpt, "kv_producer", device, transport)
    proc = InputProcessor(Tokenizer.from_pretrained(ckpt), core.max_model_len, core.vocab_size)
    one = SamplingParams(temperature=0, max_tokens=1)
    out = []
    for i, ids in enumerate(_prompts()):
        core.add_request(proc.make_request(f"r{i}", ids, one, {"do_remote_decode": True}))
        params = None
        while params is None:
            for o in core.step():
                params = o.kv_transfer_params or params
        out.append(params)
    conn.send(out)
    while not conn.poll(0.01):
        core.step()
        time.sleep(0.002)
    core.shutdown()


def equality(args: argparse.Namespace) -> dict:
    from pdserve import LLM, SamplingParams
    from pdserve.frontend.processor import InputProcessor
    from pdserve.frontend.tokenizer import Tokenizer

    ckpt = args.ckpt
    if ckpt is None:
        from pdserve.testing.checkpoint import make_checkpoint

        ckpt = str(make_checkpoint("LlamaForCausalLM", "tiny", tempfile.mkdtemp(), seed=3))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(
        ckpt,
        dtype=_dtype(args.device),
        block_size=BLOCK,
        device=args.device,
        enforce_eager=True,
        **({"gpu_memory_utilization": 0.15} if args.device != "cpu" else {}),
    )
    want = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in _prompts()], sp)
    ]
    llm.engine.shutdown()
    del llm
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()  # the KV pools below are sized from what is free
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    transport = args.equality_transport
    proc = ctx.Process(target=prefill_engine, args=(ckpt, args.device, transport, child))
    proc.start()
    d = _engine(ckpt, "kv_consumer", args.device, transport)
    dp = InputProcessor(Tokenizer.from_pretrained(ckpt), d.max_model_len, d.vocab_size)
    got: dict[str, list[int]] = {}
    try:
        assert parent.poll(300), "the prefill engine did not answer"
        for i, params in enumerate(parent.recv()):
            d.add_request(dp.make_request(f"r{i}", _prompts()[i], sp, params))
        deadline, done = time.monotonic() + 120, set()
        while len(done) < len(_prompts()):
            assert time.monotonic() < deadline, f"decode did not finish: {done}"
            for o in d.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    done.add(o.request_id)
        st = d.stats()
        tokens = [got[f"r{i}"] for i in range(len(_prompts()))]
        return {
            "transport": transport,
            "dtype": _dtype(args.device),
            "identical": tokens == want,
            "prompts": [len(p) for p in _prompts()],
            "transfer_failures": st.kv_transfer_failures,
            "external_kv_tokens": st.prompt_tokens_by_source["external_kv_transfer"],
        }
    finally:
        parent.send("stop")
        proc.join(60)
        d.shutdown()


def _print_transfers(rows: list[dict]) -> None:
    print(
        f"{'transport':>9} {'variant':>7} {'prompt':>7} {'GB':>6} {'copy ms':>8} {'kern ms':>7} "
        f"{'rtt ms':>7} {'seq ms':>7} {'xfer ms':>8} {'done ms':>7} {'bound ms':>8} "
        f"{'copy/bd':>7} {'kern/bd':>7} {'xfer/bd':>7} early"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['transport']:>9} failed: {r['error']}", flush=True)
            continue
        kern = f"{r['kernel_ms']:>7.2f}" if "kernel_ms" in r else f"{'-':>7}"
        kbd = f"{r['kernel_ratio']:>7.2f}" if "kernel_ratio" in r else f"{'-':>7}"
        print(
            f"{r['transport']:>9} {r['variant']:>7} {r['prompt']:>7} {r['bytes'] / 1e9:>6.2f} "
            f"{r['copy_ms']:>8.2f} {kern} {r['rtt_ms']:>7.2f} {r['sequential_ms']:>7.2f} "
            f"{r['transfer_ms']:>8.2f} {r['done_ms']:>7.2f} {r['bound_ms']:>8.3f} "
            f"{r['copy_ratio']:>7.2f} {kbd} {r['transfer_ratio']:>7.2f} {r['early']}",
            flush=True,
        )
    posted = [r for r in rows if "post_ms" in r]
    if posted:  # the sequential read over nixl: on the host until posted, then polled done
        print("nixl read (sequential), ms: posted (ids checked, descriptors made, READ posted),"
              " then landed (polled done) after")  # fmt: skip
        for r in posted:
            print(f"{r['transport']:>9} {r['variant']:>7} {r['prompt']:>7}  posted "
                  f"{r['post_ms']:.3f}  landed {r['land_ms']:.3f}", flush=True)  # fmt: skip
    timed = [r for r in rows if "gpu_start_ms" in r]
    if timed:  # where the early read's time goes (ms after start_read was called)
        print("early read, ms after it began: launch returned (host ms in the launch: ids "
              "checked + uploaded + kernel launched), reply arrived, copy on the GPU from .. "
              "to, landed")  # fmt: skip
        for r in timed:
            parts = "+".join(f"{r[k]:.3f}" for k in ("ids_host_ms", "upload_host_ms",
                                                     "kernel_host_ms") if k in r)  # fmt: skip
            print(
                f"{r['transport']:>9} {r['variant']:>7} {r['prompt']:>7}  launched "
                f"{r['launched_ms']:.3f} ({r['launch_host_ms']:.3f}{' = ' + parts if parts else ''})"
                f"  reply {r['reply_ms']:.3f}  gpu {r['gpu_start_ms']:.3f}..{r['gpu_end_ms']:.3f}"
                f"  landed {r['transfer_ms']:.3f}",
                flush=True,
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefill-device", default=None, help="default: --device")
    ap.add_argument(
        "--transports", default=None,
        help="default: cuda_ipc,nixl (nixl if importable); nixl:N: nixl with N UCX threads "
        "(nixl: the serve default's; nixl:0: one worker)",
    )
    ap.add_argument("--lens", default="1024,16384,65536")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ckpt", default=None, help="equality model (default: a tiny random Llama)")
    ap.add_argument("--no-equality", action="store_true")
    ap.add_argument(
        "--variants",
        default="after",
        help="early-copy variants, each measured over its own link: before (launch the "
        "copy, then send the read), send (send, then launch), flush (launch, query its "
        "event, send), after (send, launch, query: the default); the query is cuda_ipc's",
    )
    ap.add_argument(
        "--copy-shape", default=None, help="cuda_ipc's block-copy launch shape STEP_BYTES:WARPS"
    )
    ap.add_argument(
        "--copy-shapes",
        default=None,
        help="also time the block-copy kernel alone (CUDA only) for these shapes, e.g. "
        "8192:4,16384:8,32768:8",
    )
    ap.add_argument(
        "--equality-transport", default="nixl", help="the 1P1D engines' transport (part 2)"
    )
    args = ap.parse_args()
    args.prefill_device = args.prefill_device or args.device
    os.environ.setdefault(SECRET_ENV, new_secret())  # the engines' side channel (inherited)
    args.lens = sorted(int(x) for x in args.lens.split(","))
    args.variants = args.variants.split(",")
    if bad := [v for v in args.variants if v not in VARIANTS]:
        ap.error(f"unknown --variants {bad} ({', '.join(VARIANTS)})")
    try:
        args.copy_shape = _shape(args.copy_shape) if args.copy_shape else (None, None)
        args.copy_shapes = (
            [_shape(x) for x in args.copy_shapes.split(",")] if args.copy_shapes else []
        )
    except ValueError as e:
        ap.error(str(e))
    if args.copy_shapes and not args.device.startswith("cuda"):
        ap.error("--copy-shapes times the Triton kernel: it needs a CUDA --device")
    args.blocks = len(held_blocks(max(args.lens))) + 64
    res: dict = {
        "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "decode_device": args.device,
        "prefill_device": args.prefill_device,
    }
    try:
        from pdserve.kv_transfer.transports.nixl import load_nixl

        load_nixl()
        has_nixl = True
    except RuntimeError as e:
        has_nixl, res["nixl_missing"] = False, str(e)
    if args.transports is None:
        args.transports = ",".join(["cuda_ipc", "nixl"] if has_nixl else ["cuda_ipc"])
    if args.copy_shape != (None, None) and "cuda_ipc" not in args.transports.split(","):
        ap.error("--copy-shape is cuda_ipc's block-copy launch shape: add cuda_ipc")
    t0 = time.perf_counter()
    res["transfers"] = transfers(args)
    _print_transfers(res["transfers"])
    if args.copy_shapes:
        res["copy_shapes"] = copy_shapes(args)
        print(
            f"{'prompt':>7} {'step B':>7} {'warps':>5} {'kernel ms':>9} {'bound ms':>8} {'k/bd':>5}"
        )
        for r in res["copy_shapes"]:
            print(
                f"{r['prompt']:>7} {r['step_bytes']:>7} {r['num_warps']:>5} {r['kernel_ms']:>9.3f} "
                f"{r['bound_ms']:>8.3f} {r['ratio']:>5.2f}",
                flush=True,
            )
    over = args.equality_transport
    if not args.no_equality and (has_nixl or over != "nixl"):
        key = f"{over}_equality"  # nixl_equality: the name earlier runs recorded
        try:
            res[key] = equality(args)
        except Exception as e:
            res[key] = {"error": f"{type(e).__name__}: {e}"}
        print(f"1P1D over {over} vs colocated:", res[key], flush=True)
    res["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
