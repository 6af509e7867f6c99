"""Why is the first request slower than the steady state? One in-process engine on a fresh
Triton cache: after start-up, time one-token generations at several prompt lengths (each
twice) and list the Triton kernels compiled by each.

    python3 benchmarks/warm_diag.py --ckpt /tmp/llama-8b --out $OUT/warm_diag.json

``--device cpu`` runs the same code on a tiny Llama (made in a temporary folder unless
``--ckpt`` is given) at short lengths: a smoke run of the script.
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t) * 1e3


def attribute(llm: LLM, lengths: tuple[int, ...] = (1301, 913, 1777)) -> dict:
    """First and second call (ms) of the prompt path's pieces at token counts no request
    has used yet: SDPA with torch's default backend choice, SDPA restricted to flash /
    memory-efficient, and the layer GEMMs (the model's heads, head size and dtype)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runner = llm.engine.runner
    hc, dev = runner.hf_config, runner.device
    layer = runner.model.model.layers[0]
    mats = [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
    mats += [layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    dt = mats[0].dtype
    out: dict = {}
    for n in lengths:
        q = torch.randn(1, hc.num_attention_heads, n, hc.head_dim, dtype=dt, device=dev)

        def sdpa(q=q) -> None:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

        def sdpa_flash(q=q) -> None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)

        def gemms(n=n) -> None:
            for w in mats:
                F.linear(torch.randn(n, w.shape[1], dtype=w.dtype, device=dev), w)

        for name, fn in (("sdpa_flash", sdpa_flash), ("gemms", gemms), ("sdpa_default", sdpa)):
            out[f"{name}_{n}"] = [round(_timed(fn), 2), round(_timed(fn), 2)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint folder (required on cuda; cpu: a tiny one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", help="prompt lengths, in order (cpu: short ones)")
    ap.add_argument("--engine-args", default="{}", help="JSON kwargs for LLM")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if args.ckpt is None and not cpu:
        ap.error("--ckpt is needed on cuda (make one with pdserve make-checkpoint)")
    default = "33,33,32,32,17,17,1,1" if cpu else "1031,1031,1024,1024,777,777,1,1"
    args.lengths = args.lengths or default
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is None:
            from pdserve.testing.checkpoint import make_checkpoint

            args.ckpt = str(make_checkpoint("LlamaForCausalLM", "tiny", tmp, dtype="float32"))
        return run(args)


def run(args: argparse.Namespace) -> int:
    cpu = args.device == "cpu"
    kw: dict = dict(device="cpu", dtype="float32", max_model_len=256) if cpu else dict(
        dtype="bfloat16", max_model_len=4096)  # fmt: skip
    t0 = time.perf_counter()
    llm = LLM(args.ckpt, **kw, **json.loads(args.engine_args))
    res: dict = {"startup_s": time.perf_counter() - t0, "phases": llm.engine.warmup_phases}
    seen = cached_kernels()
    res["kernels_at_ready"] = len(seen)
    g = torch.Generator().manual_seed(0)
    rows = []
    vocab = min(30000, llm.engine.vocab_size)
    for n in map(int, args.lengths.split(",")):
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        _sync()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=1.0))
        _sync()
        now = cached_kernels()
        rows.append(
            {"len": n, "ms": (time.perf_counter() - t) * 1e3, "compiled": sorted(now - seen)}
        )
        seen = now
        print(json.dumps(rows[-1]), flush=True)
    res["rows"] = rows
    res["first_call_ms"] = attribute(llm, (37, 29, 45) if cpu else (1301, 913, 1777))
    print(json.dumps(res["first_call_ms"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
