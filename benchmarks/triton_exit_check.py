"""Does a process that ran pdserve's Triton kernels exit without nanobind "leaked" reports?

A Triton built with nanobind prints ``nanobind: leaked N instances/types/functions`` at
interpreter exit for every binding object still alive then. pdserve releases its
kernels' caches and collects garbage at exit (``pdserve.layers.fused.release_triton``).
This runs a small engine (tiny random checkpoint, a few greedy tokens) in a child
process three ways and reports what each printed at exit:

* ``released``: as pdserve runs (the exit hook on);
* ``hook_off``: the hook unregistered (what the reports were before it);
* ``census``: the hook run by hand, then a census of the Triton binding objects still
  alive and the types of what refers to them (where a leak comes from, if any is left).

    python3 benchmarks/triton_exit_check.py --device cuda --out $OUT/triton_exit.json

Prints one table row per way; exit status 0 when ``released`` printed no leak report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

CHILD = r"""
import atexit, gc, json, sys
from pdserve import LLM, SamplingParams
from pdserve.layers.fused import release_triton
from pdserve.testing.checkpoint import make_checkpoint
ckpt = make_checkpoint("LlamaForCausalLM", "tiny", sys.argv[1], seed=1, dtype="float32")
llm = LLM(str(ckpt), dtype="float32", device=sys.argv[2], max_model_len=256)
print(llm.generate("hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
llm.shutdown()
mode = sys.argv[3]
if mode != "released":
    atexit.unregister(release_triton)
if mode == "census":
    release_triton()
    alive = [o for o in gc.get_objects() if type(o).__module__.startswith("triton._C")]
    holders = {}
    for o in alive[:50]:
        for r in gc.get_referrers(o):
            if r is not alive:
                holders[type(r).__name__] = holders.get(type(r).__name__, 0) + 1
    print("CENSUS " + json.dumps({"alive": len(alive),
          "types": sorted({type(o).__name__ for o in alive}), "holders": holders}))
"""


def run(mode: str, device: str, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(work / f"ckpt-{mode}"), device, mode],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    err = done.stderr
    census = next(
        (json.loads(ln[7:]) for ln in done.stdout.splitlines() if ln.startswith("CENSUS ")), None
    )
    return {
        "mode": mode,
        "returncode": done.returncode,
        "leak_report": "nanobind: leaked" in err,
        "leak_lines": [ln for ln in err.splitlines() if "nanobind: leaked" in ln][:6],
        "census": census,
        "stderr_tail": err[-1500:] if done.returncode else "",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="triton_exit.json")
    ap.add_argument("--work", default="/tmp/triton-exit-check")
    ap.add_argument("--modes", nargs="+", default=["released", "hook_off", "census"])
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run(mode, args.device, work) for mode in args.modes]
    print(f"{'mode':<10} {'rc':>3} {'leak report':>12}  first lines")
    for r in rows:
        print(
            f"{r['mode']:<10} {r['returncode']:>3} {str(r['leak_report']):>12}  {r['leak_lines'][:2]}"
        )
        if r["census"] is not None:
            print(f"{'':<10} census: {r['census']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "runs": rows}, indent=1))
    ok = rows[0]["returncode"] == 0 and not rows[0]["leak_report"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
