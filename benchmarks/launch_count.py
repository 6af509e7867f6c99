"""Device launches of one graph-shaped decode step, per decoder layer by submodule
(issue 30; :mod:`pdserve.profiling.launch_count` counts them).

    python3 benchmarks/launch_count.py --out /tmp/launches.json                    (CPU, tiny)
    python3 benchmarks/launch_count.py --device cuda --out $OUT/launches.json \
        --points glm5=glm5-m12-e64,llama=llama-8b-shape --context 1024 --width 32768

On a CPU the tiny GLM-5 and Llama run their CUDA code paths under Triton's interpreter
(``TRITON_INTERPRET=1`` and ``PDSERVE_FUSED_KERNELS=1``, set before any kernel module is
imported); on a GPU the same counter runs compiled, at real presets (weights drawn on
the device, ``--load-format dummy``), and its step total can be set beside the kernels
per step that ``glm5_bench.py --profile`` sees in the graph replay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

ARCH = {"glm5": "GlmMoeDsaForCausalLM", "llama": "LlamaForCausalLM"}


def parse_points(text: str) -> list[tuple[str, str]]:
    """``glm5=tiny,llama=llama-8b-shape`` -> [(family, preset), ...]."""
    out = []
    for item in text.split(","):
        fam, _, preset = item.partition("=")
        if fam not in ARCH or not preset:
            raise ValueError(f"point {item!r} is not FAMILY=PRESET with FAMILY in {list(ARCH)}")
        out.append((fam, preset))
    return out


def count_preset(name: str, preset: str, device: str, dtype: str, batch: int, context: int,
                 width: int, workdir: Path, layers: int | None = None) -> dict:  # fmt: skip
    import torch

    from pdserve.models import load_model
    from pdserve.profiling.launch_count import (
        decode_step,
        decode_step_launches,
        format_table,
        layer_table,
    )
    from pdserve.testing.checkpoint import make_checkpoint

    arch = ARCH[name]
    over = {"num_hidden_layers": layers} if layers else None
    ckpt = make_checkpoint(arch, preset, workdir / f"{arch}-{preset}", config_only=True,
                           config_overrides=over)  # fmt: skip
    model, cfg = load_model(ckpt, dtype, torch.device(device), load_format="dummy")
    t0 = time.perf_counter()
    counts = decode_step_launches(model, batch, context, width)
    seconds = time.perf_counter() - t0
    profiled = None
    if device == "cuda":  # the kernels the device really ran for the same step
        from pdserve.profiling.step_profile import profile_step

        prof = profile_step(decode_step(model, batch, context, width), None, device)
        profiled = {
            "kernels": len(prof.spans),
            "names": dict(Counter(s.name[:80] for s in prof.spans)),
        }
        print(f"profiled: {len(prof.spans)} device activities (kernels, copies, memsets) "
              f"against {counts.total} counted", flush=True)  # fmt: skip
    names, per = layer_table(counts)
    table = format_table(counts)
    print(f"\n{arch} {preset} ({dtype}, {device}): batch {batch}, context {context}, "
          f"width {width}\n{table}", flush=True)  # fmt: skip
    del model
    return {
        "arch": arch,
        "preset": preset,
        "layers": cfg.num_hidden_layers,
        "total": counts.total,
        "per_layer": {str(i): dict(c) for i, c in per.items()},
        "outside_layers": dict(counts.outside_layers()),
        "syncs": [s.name for s in counts.syncs],
        "multi_kernel": dict(counts.multi_kernel()),
        "by_name": dict(counts.by_name()),
        "seconds": seconds,
        "profiled": profiled,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--points",
        default=None,
        help="FAMILY=PRESET,... (families: glm5, llama; default glm5=tiny,"
        "llama=tiny; on CUDA glm5=glm5-m12-e64,llama=llama-8b-shape)",
    )
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")  # fmt: skip
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=None, help="cached tokens (CPU 32, GPU 1024)")
    ap.add_argument("--width", type=int, default=None,
                    help="the captured max_seq_len (CPU 64, GPU 32768)")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:  # the kernels under the interpreter: set before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["PDSERVE_FUSED_KERNELS"] = "1"
        from _interp import interpreter_fix

        interpreter_fix()
    default = "glm5=tiny,llama=tiny" if cpu else "glm5=glm5-m12-e64,llama=llama-8b-shape"
    points = parse_points(args.points or default)
    context = args.context if args.context is not None else (32 if cpu else 1024)
    width = args.width if args.width is not None else (64 if cpu else 32768)
    res = {"device": args.device, "batch": args.batch, "context": context, "width": width,
           "dtype": args.dtype, "models": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        for name, preset in points:
            res["models"].append(count_preset(name, preset, args.device, args.dtype, args.batch,
                                              context, width, Path(d), args.layers))  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2))
    for m in res["models"]:
        per = m["per_layer"]
        mean = sum(sum(c.values()) for c in per.values()) / max(1, len(per))
        print(f"{m['arch']:24s} {m['preset']:16s} step {m['total']:5d}  "
              f"{mean:6.1f} a layer over {m['layers']} layers")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
