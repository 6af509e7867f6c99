"""benchmarks/pick_mla_variant.py: the variant run end to end after the sweep."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "pick_mla_variant.py"
_spec = importlib.util.spec_from_file_location("pick_mla_variant", SCRIPT)
assert _spec is not None and _spec.loader is not None
pick_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_mod)


def _row(case: str, config: str, total: float, diff: float = 0.0, variant: bool = True) -> dict:
    r = {"case": case, "config": config, "ms": total, "total_ms": total, "max_abs_diff": diff}
    if variant:
        r["variant"] = [64, 32, 8, 5]
    return r


def test_picks_the_fastest_agreeing_variant_of_the_first_case() -> None:
    rows = [
        _row("prefill 16K", "general [64, 32, 8, 3]", 33.0, variant=False),
        _row("prefill 16K", "general [64, 64, 8, 2]", 31.0, variant=False),
        _row("prefill 16K", "rows_a", 20.0, diff=0.5),  # fastest, but its output disagrees
        _row("prefill 16K", "rows_b", 25.0),
        _row("prefill 16K", "rows_c", 28.0),
        {"case": "prefill 16K", "config": "rows_d", "variant": [1], "error": "OutOfResources"},
        _row("prefill 4K", "rows_c", 1.0),  # a shorter case does not decide
    ]
    assert pick_mod.pick(rows) == "rows_b"


def test_none_when_no_variant_beats_the_general_kernel(tmp_path: Path) -> None:
    rows = [_row("prefill 16K", "general [64, 64, 8, 2]", 31.0, variant=False),
            _row("prefill 16K", "rows_b", 32.0)]  # fmt: skip
    assert pick_mod.pick(rows) is None
    assert pick_mod.pick([]) is None
    f = tmp_path / "v.json"
    f.write_text(json.dumps({"mla_variants": rows}))
    done = subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == ""
    f.write_text(json.dumps({"mla_variants": rows[:1] + [_row("prefill 16K", "rows_e", 9.0)]}))
    done = subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True)
    assert done.stdout.strip() == "rows_e"
