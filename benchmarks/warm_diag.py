"""Why is the first request slower than the steady state? One in-process engine on a fresh
Triton cache: after start-up, time one-token generations at several prompt lengths (each
twice) and list the Triton kernels compiled by each.

    python3 benchmarks/warm_diag.py --ckpt /tmp/llama-8b --out $OUT/warm_diag.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

cache = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = cache  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402


def cached_kernels() -> set[str]:
    return {p.name for p in Path(cache).rglob("*.json") if not p.name.startswith("__grp__")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="1031,1031,1024,1024,777,777,1,1")
    ap.add_argument("--engine-args", default="{}", help="JSON kwargs for LLM")
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.ckpt, dtype="bfloat16", max_model_len=4096, **json.loads(args.engine_args))
    res: dict = {"startup_s": time.perf_counter() - t0, "phases": llm.engine.warmup_phases}
    seen = cached_kernels()
    res["kernels_at_ready"] = len(seen)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(10, 30000, (n,), generator=g).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=1.0))
        torch.cuda.synchronize()
        now = cached_kernels()
        rows.append(
            {"len": n, "ms": (time.perf_counter() - t) * 1e3, "compiled": sorted(now - seen)}
        )
        seen = now
        print(json.dumps(rows[-1]), flush=True)
    res["rows"] = rows
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
