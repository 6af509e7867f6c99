"""Decode throughput with structured output and with penalties (issue 17), in one process.

    python3 benchmarks/structured_bench.py --ckpt /tmp/llama-8b --out $OUT/structured.json

One engine (``llama-8b-shape``, bf16, async scheduling on, CUDA graphs as configured) runs
the same batch five times: no constraint, a JSON schema on every request, penalties on
every request (presence 0.5, frequency 0.5, repetition 1.1), both, and the JSON schema
again with its masks filled before the step is launched (``:land_first``, the order
without deferred masks; the others defer them, see
:mod:`pdserve.engine.structured_output`). Each run adds
``--batch`` requests of ``--prompt-len`` random tokens, prefills them, runs a few
warm-up steps, then times ``--steps`` engine steps and counts the tokens they produced:
decode tok/s = tokens / seconds, and the step time. The schema is an array of exactly
``ITEMS`` small objects, so no constrained request finishes inside the timed steps (the
batch stays whole; ``running_during_timing`` says so). Sampling is random
(temperature 1, a seed per request): a constraint costs its bitmask fill (on the host,
one multi-threaded xgrammar call per step, overlapped with the step's forward under
async scheduling: the masks are deferred until the step before has landed) and its
mask on the device.

``--speculative-config`` runs the same with speculative decoding (MTP on a GLM-5-family
checkpoint, n-gram on any): each verified position then has its own bitmask row and
penalty counts, and a step may produce several tokens per request.

``--device cpu`` runs the script itself on a tiny checkpoint (made in a temporary folder
when ``--ckpt`` is not given), for a smoke test. Prints a table last; every number goes
to the JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.core_types.sampling_params import StructuredOutputsParams  # noqa: E402

ITEMS = 48  # schema items: about 10 tokens each, far more than the timed steps
SCHEMA = {
    "type": "array",
    "minItems": ITEMS,
    "maxItems": ITEMS,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "kind", "ok"],
    },
}
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
VARIANTS = ("free", "json_schema", "penalties", "json_schema+penalties", "json_schema:land_first")


def _params(variant: str, seed: int, max_tokens: int) -> SamplingParams:
    kw: dict[str, Any] = dict(PENALTIES) if "penalties" in variant else {}
    if "json_schema" in variant:
        kw["structured_outputs"] = StructuredOutputsParams(json=json.dumps(SCHEMA))
    else:
        kw["ignore_eos"] = True
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, **kw)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(
    llm: LLM, variant: str, batch: int, prompt_len: int, steps: int, device: str
) -> dict[str, Any]:
    eng = llm.engine
    # ":land_first": masks filled only after the step in flight landed, before the next
    # step is launched (no overlap with the forward: the order before deferred masks)
    eng.scheduler.defer_masks = not variant.endswith(":land_first")
    g = torch.Generator().manual_seed(len(variant))
    vocab = min(eng.vocab_size, 30000)
    max_tokens = steps * (1 + eng.runner.num_spec) + 16  # a verify may take 1 + k a step
    for i in range(batch):
        ids = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        eng.add_request(
            llm.processor.make_request(f"{variant}-{i}", ids, _params(variant, i, max_tokens))
        )
    t_prefill = time.perf_counter()
    while (
        eng.structured.pending
        or eng.scheduler.waiting
        or any(not r.output_token_ids for r in eng.scheduler.requests.values())
    ):
        eng.step()
    prefill_s = time.perf_counter() - t_prefill
    for _ in range(3):
        eng.step()
    _sync(device)
    sizes: list[int] = []
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        sizes.append(len(eng.scheduler.running))
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    _sync(device)
    dt = time.perf_counter() - t0
    eng.abort_requests(list(eng.scheduler.requests))
    eng.set_async_scheduling(False)  # land the step left in flight
    eng.step()
    eng.set_async_scheduling(True)
    return {
        "variant": variant,
        "batch": batch,
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens": tokens,
        "seconds": dt,
        "decode_tok_s": tokens / dt,
        "step_ms": dt / steps * 1e3,
        "prefill_s": prefill_s,
        "running_during_timing": [min(sizes), max(sizes)],
    }


def run(
    ckpt: str,
    batch: int,
    prompt_len: int,
    steps: int,
    device: str,
    load_format: str = "auto",
    speculative: dict[str, Any] | None = None,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        load_format=load_format,
        max_model_len=prompt_len + 8 * steps + 64,  # room for accepted drafts (k <= 7)
        max_num_seqs=max(batch, 8),
        async_scheduling=True,
        speculative_config=speculative,
    )
    if device == "cuda":
        kwargs.update(dtype="bfloat16", max_num_batched_tokens=8192, gpu_memory_utilization=0.85)
    else:
        kwargs.update(dtype="float32", device="cpu")
    llm = LLM(ckpt, **kwargs)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "ckpt": ckpt,
        "load_format": load_format,
        "cudagraph_mode": llm.engine.runner.graph_mode(),
        "schema": SCHEMA,
        "penalties": PENALTIES,
        "speculative": speculative,
    }
    # warm-up: compiles the schema once (cached) and runs each path once
    for v in VARIANTS:
        run_variant(llm, v, min(batch, 4), min(prompt_len, 64), 4, device)
    res["runs"] = [run_variant(llm, v, batch, prompt_len, steps, device) for v in VARIANTS]
    free = res["runs"][0]["decode_tok_s"]
    for r in res["runs"]:
        r["vs_free"] = r["decode_tok_s"] / free
    return res


def print_table(res: dict[str, Any]) -> None:
    print(f"{'variant':<24}{'batch':>6}{'tok/s':>10}{'step ms':>9}{'vs free':>9}  running")
    for r in res["runs"]:
        print(
            f"{r['variant']:<24}{r['batch']:>6}{r['decode_tok_s']:>10.1f}{r['step_ms']:>9.2f}"
            f"{r['vs_free']:>9.3f}  {r['running_during_timing']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint folder (cpu: tiny one if unset)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="dummy: random weights drawn on the device (a --config-only checkpoint will do)",
    )
    ap.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\': the same runs '
        "with speculative decoding (each verified position masked and penalised)",
    )
    args = ap.parse_args(argv)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt
        if ckpt is None:
            if args.device == "cuda":
                ap.error("--ckpt is needed on cuda (make one with pdserve make-checkpoint)")
            from pdserve.testing.checkpoint import make_checkpoint

            make_checkpoint("LlamaForCausalLM", "tiny", tmp, dtype="float32")
            ckpt = tmp
        res = run(
            ckpt, args.batch, args.prompt_len, args.steps, args.device, args.load_format, spec
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print_table(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
