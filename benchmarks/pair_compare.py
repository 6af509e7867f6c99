"""Issue 31's speed verdict: the same decode points run by the tree before the step-machinery
redesign (baseline) and by this one (current), several rounds each in one device call
(``run_pending.sh r11``/``r11g``/``r11all`` write the files this reads):

    python3 benchmarks/pair_compare.py --dir $OUT --out $OUT/r11_compare.json

``r11_<tree>_<round>.json`` (gpu_suite.py decode: llama-8b-shape, each point synchronous
and asynchronous, the engine's default) and ``r11g_<tree>_<round>.json`` (glm5_bench.py speed: glm5-m12-e64, the
engine's default scheduling). Per point: each tree's median step over its rounds, and
current / baseline; a point passes when the ratio is at most 1 + ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"^(r11g?)_(baseline|current)_(\d+)\.json$")


def points(kind: str, res: dict) -> dict[str, float]:
    """Step ms by point name of one run's JSON."""
    if kind == "r11":  # gpu_suite decode rows: a synchronous step and an asynchronous one
        out = {}
        for r in res["decode"]:
            at = f"llama b{r['batch']} x{r['ctx']}"
            if "step_ms" in r:
                out[f"{at} sync"] = r["step_ms"]
            if r.get("async_step_ms") is not None:
                out[f"{at} async (default)"] = r["async_step_ms"]
        return out
    return {  # glm5_bench speed rows
        f"{s['preset']} b{r['batch']} x{r['ctx']}": r["step_ms"]
        for s in res["speed"]
        for r in s["decode"]
    }


def compare(files: list[Path], tolerance: float) -> list[dict]:
    """One row per point both trees ran: medians, rounds, ratio, verdict."""
    runs: dict[tuple[str, str], list[float]] = {}
    for f in sorted(files):
        m = NAME.match(f.name)
        if m is None:
            continue
        for name, ms in points(m[1], json.loads(f.read_text())).items():
            runs.setdefault((name, m[2]), []).append(ms)
    rows = []
    for name in sorted({n for n, _ in runs}):
        base, cur = runs.get((name, "baseline")), runs.get((name, "current"))
        if not base or not cur:
            continue
        b, c = statistics.median(base), statistics.median(cur)
        rows.append({"point": name, "baseline_ms": b, "current_ms": c, "baseline_runs": base,
                     "current_runs": cur, "ratio": c / b, "ok": c / b <= 1 + tolerance})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="where the r11 runs wrote their JSON")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--tolerance", type=float, default=0.02)
    args = ap.parse_args(argv)
    rows = compare(list(Path(args.dir).glob("r11*.json")), args.tolerance)
    if not rows:
        print("no point was run by both trees")
        return 1
    print(f"{'point':32s} {'baseline ms':>11s} {'current ms':>10s} {'ratio':>6s}  runs (b | c)")
    for r in rows:
        runs = " ".join(f"{x:.2f}" for x in r["baseline_runs"]) + " | " + " ".join(
            f"{x:.2f}" for x in r["current_runs"]
        )
        flag = "" if r["ok"] else f"  > {1 + args.tolerance:.2f}"
        print(f"{r['point']:32s} {r['baseline_ms']:11.2f} {r['current_ms']:10.2f} "
              f"{r['ratio']:6.3f}  {runs}{flag}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"tolerance": args.tolerance, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
