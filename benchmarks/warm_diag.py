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


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def attribute(llm: LLM) -> dict:
    """First and second call (ms) of the prompt path's pieces at token counts no request
    has used yet: SDPA with torch's default backend choice, SDPA restricted to flash /
    memory-efficient, and the layer GEMMs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layer = llm.engine.runner.model.model.layers[0]
    mats = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
    mats += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    out: dict = {}
    for n in (1301, 913, 1777):
        q = torch.randn(1, 32, n, 128, dtype=torch.bfloat16, device="cuda")

        def sdpa(q=q) -> None:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

        def sdpa_flash(q=q) -> None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)

        def gemms(n=n) -> None:
            for w in mats:
                F.linear(torch.randn(n, w.shape[1], dtype=w.dtype, device="cuda"), w)

        for name, fn in (("sdpa_flash", sdpa_flash), ("gemms", gemms), ("sdpa_default", sdpa)):
            out[f"{name}_{n}"] = [round(_timed(fn), 2), round(_timed(fn), 2)]
    return out


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
    res["first_call_ms"] = attribute(llm)
    print(json.dumps(res["first_call_ms"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
