"""Where the host's time goes in a synchronous decode step, phase by phase.

Under synchronous scheduling nothing of the host overlaps the device: a step is the
host's scheduling and batch prep, the device's work, the wait for it, and the host's
landing of the results. This script times those phases of ``LLM.engine.step()`` with
wrappers on the functions every tree since the step-machinery redesign's baseline has
(``Scheduler.schedule``, ``StepPreparer.prepare``, ``Scheduler.update_from_output``,
``torch.cuda.CUDAGraph.replay``, ``torch.cuda.Event.synchronize``), and counts the
Triton launches the host makes outside graphs and their host time
(``JITFunction.run``). Run it with another tree's ``src`` first on ``PYTHONPATH`` to
compare trees (issue 31's "no speed lost"); it imports nothing else from the project.

Per batch: the median over ``--reps`` rounds of ``--steps`` steps of each phase's host
microseconds a step; ``other`` is the step less the timed phases (sampling launches,
copy-out, the engine's plumbing). ``syncs``: the project's source lines where torch's
sync debug mode saw the host wait for the device in three more steps.

    python benchmarks/host_phases.py --ckpt CKPT --batches 1,16,64 --top 25 --out a.json
    python benchmarks/host_phases.py --compare a.json b.json --out diff.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PHASES = ("schedule", "prepare", "replay", "triton", "wait", "update")


def _wrap(owner: Any, name: str, key: str, acc: collections.Counter, counts: collections.Counter):
    """Time ``owner.name`` into ``acc[key]`` (seconds) and count its calls; returns an undo."""
    orig = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
            counts[key] += 1

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, orig)


def instrument(acc: collections.Counter, counts: collections.Counter) -> list[Callable[[], None]]:
    from pdserve.engine.scheduler import Scheduler
    from pdserve.runner.step_inputs import StepPreparer

    undo = [
        _wrap(Scheduler, "schedule", "schedule", acc, counts),
        _wrap(Scheduler, "update_from_output", "update", acc, counts),
        _wrap(StepPreparer, "prepare", "prepare", acc, counts),
    ]
    if torch.cuda.is_available():
        undo.append(_wrap(torch.cuda.CUDAGraph, "replay", "replay", acc, counts))
        undo.append(_wrap(torch.cuda.Event, "synchronize", "wait", acc, counts))
    try:
        from triton.runtime.jit import JITFunction

        undo.append(_wrap(JITFunction, "run", "triton", acc, counts))
    except ImportError:  # pragma: no cover - triton ships with torch here
        pass
    return undo


def _add(llm: Any, rid: str, ids: list[int], max_tokens: int) -> None:
    from pdserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.add_request(llm.processor.make_request(rid, ids, sp))


def measure(llm: Any, batch: int, ctx: int, steps: int, reps: int, top: int = 0) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    vocab = int(llm.engine.runner.vocab_size)
    for i in range(batch):
        ids = torch.randint(10, vocab - 10, (ctx,), generator=g).tolist()
        _add(llm, f"h{batch}-{i}", ids, 8 + steps * (reps + 1) + 8)
    while eng.scheduler.waiting or any(
        not r.output_token_ids for r in eng.scheduler.requests.values()
    ):
        eng.step()
    eng.set_async_scheduling(False)
    for _ in range(5):
        eng.step()
    acc: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    undo = instrument(acc, counts)
    rounds: list[dict[str, float]] = []
    try:
        for _ in range(reps):
            acc.clear()
            counts.clear()
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            total = time.perf_counter() - t
            r = {k: acc[k] / steps * 1e6 for k in PHASES}
            r["other"] = (total - sum(acc.values())) / steps * 1e6
            r["step"] = total / steps * 1e6
            r["triton_launches"] = counts["triton"] / steps
            rounds.append(r)
    finally:
        for u in undo:
            u()
    running = len(eng.scheduler.running)  # the whole batch, still decoding
    syncs = sync_sites(eng, 3)
    hot = hot_functions(eng, steps, top) if top else []
    eng.abort_requests(list(eng.scheduler.requests))
    eng.step()
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out.update(batch=batch, ctx=ctx, running=running, syncs=syncs, hot=hot)
    return out


def hot_functions(eng: Any, steps: int, top: int) -> list[dict]:
    """The ``top`` functions by own host time over ``steps`` more steps (cProfile; its
    overhead inflates call-heavy code, so compare trees, not absolute numbers)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(steps):
            eng.step()
    finally:
        prof.disable()
    stats: dict = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{fn.rsplit('/src/', 1)[-1]}:{line}({name})",
            "us_per_step": tt / steps * 1e6,
            "calls_per_step": nc / steps,
        }
        for (fn, line, name), (_cc, nc, tt, _ct, _callers) in rows
    ]


def sync_sites(eng: Any, steps: int) -> dict[str, float]:
    """Where the host waits for the device during ``steps`` steps, besides the one wait a
    step is meant to have: the project's innermost source line on the stack of each sync
    torch's sync debug mode flags, with their count a step (a hidden sync serialises the
    host's launches after it with the device)."""
    sites: collections.Counter = collections.Counter()
    cuda = torch.cuda.is_available()

    def show(message: Any, *_: Any, **__: Any) -> None:
        if "synchroniz" in str(message):
            sites[_project_frame()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored when the block ends
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                eng.step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return {k: v / steps for k, v in sites.items()}


def _project_frame() -> str:
    """``pdserve/<module>:<line>`` of the innermost project frame on the stack (torch's
    own frame is where the warning is raised, not where the sync was asked for)."""
    for frame in reversed(traceback.extract_stack()):
        if "/pdserve/" in frame.filename:
            return f"pdserve/{frame.filename.rsplit('/pdserve/', 1)[-1]}:{frame.lineno}"
    return "outside pdserve"


def compare(paths: list[str], n: int = 12) -> list[dict]:
    """The hottest functions' host us a step in two or more runs (JSON from ``--out``),
    per batch: the ``n`` whose time differs most between the first run and the others
    (each function keyed without its line number, so trees with moved code still pair)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = []
    for i, row in enumerate(runs[0]["rows"]):
        per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(runs))
        for j, run in enumerate(runs):
            for h in run["rows"][i].get("hot", []):
                key = h["function"].split(":", 1)[0] + h["function"][h["function"].find("(") :]
                per[key][j] += h["us_per_step"]
        spread = sorted(per.items(), key=lambda kv: -max(abs(v - kv[1][0]) for v in kv[1]))
        print(f"batch {row['batch']}: host us a step, " + " | ".join(r["label"] for r in runs))
        for key, vals in spread[:n]:
            print("  " + " ".join(f"{v:8.1f}" for v in vals) + f"  {key}")
        out.append({"batch": row["batch"], "functions": dict(spread[:n])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", nargs="+", help="JSON of earlier runs: their hot functions")
    ap.add_argument("--ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--max-model-len", type=int, default=0, help="0: what the steps need")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: the largest batch")
    ap.add_argument("--top", type=int, default=0, help="also list the N hottest functions")
    args = ap.parse_args(argv)
    if args.compare:
        with open(args.out, "w") as f:
            json.dump(compare(args.compare), f, indent=1)
        return 0
    if not args.ckpt:
        ap.error("--ckpt is required unless --compare")
    from pdserve import LLM

    batches = [int(b) for b in args.batches.split(",")]
    need = args.ctx + 8 + args.steps * args.reps + 64
    kw: dict = dict(max_model_len=max(args.max_model_len, need),
                    max_num_seqs=max(args.max_num_seqs, *batches), max_num_batched_tokens=8192)  # fmt: skip
    if args.device == "cpu":
        kw["device"] = "cpu"
    llm = LLM(args.ckpt, **kw)
    import pdserve

    res = {"label": args.label, "src": pdserve.__file__, "device": args.device, "rows": []}
    print(f"host us a synchronous step ({args.label or pdserve.__file__})")
    print(
        f"{'batch':>5} " + " ".join(f"{k:>8}" for k in (*PHASES, "other", "step")) + "  triton/step"
    )
    for b in batches:
        r = measure(llm, b, args.ctx, args.steps, args.reps, args.top)
        res["rows"].append(r)
        cols = " ".join(f"{r[k]:8.0f}" for k in (*PHASES, "other", "step"))
        print(f"{b:5d} {cols}  {r['triton_launches']:.1f}", flush=True)
        for site, n in r["syncs"].items():
            print(f"      sync a step: {n:.1f} at {site}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
