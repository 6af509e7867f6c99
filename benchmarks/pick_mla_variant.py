"""The sparse_mla_prefill variant to try end to end, from a ``prefill_sweep.py --sections
mla_variants`` JSON: the one with the lowest total (candidate rows + attention) at the
longest prefill case, if it beats the general kernel's best there and its output agrees
(max abs diff under ``--max-diff``). Prints the name, or nothing.

    python3 benchmarks/pick_mla_variant.py $OUT/mla_variants.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def pick(rows: list[dict[str, Any]], max_diff: float = 0.05) -> str | None:
    timed = [r for r in rows if "ms" in r]
    if not timed:
        return None
    case = timed[0]["case"]  # the sweep runs the longest case first
    here = [r for r in timed if r["case"] == case]
    general = [r["total_ms"] for r in here if "variant" not in r]
    variants = [r for r in here if "variant" in r and r.get("max_abs_diff", 1e9) <= max_diff]
    if not general or not variants:
        return None
    best = min(variants, key=lambda r: r["total_ms"])
    return str(best["config"]) if best["total_ms"] < min(general) else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--max-diff", type=float, default=0.05)
    args = ap.parse_args(argv)
    with open(args.json) as f:
        rows = json.load(f).get("mla_variants", [])
    name = pick(rows, args.max_diff)
    if name:
        print(name)
    sys.exit(0)


if __name__ == "__main__":
    main()
