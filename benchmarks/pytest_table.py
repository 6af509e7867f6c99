"""A pass/fail table per test module from pytest's JUnit XML reports (``--junitxml``).

    # the reports of one run, grouped by module:
    python3 benchmarks/pytest_table.py a.xml b.xml --json $OUT/tests.json
    # a run of one pytest process per module (benchmarks/run_pending.sh gpu1):
    python3 benchmarks/pytest_table.py --manifest $OUT/tests/manifest.tsv --json $OUT/tests.json

A manifest has one tab-separated line per module: ``module, exit status, report, seconds,
note``. The exit status is pytest's (124 or 137: killed by ``timeout``), or ``-`` for a
module that did not run, with the reason in the note (``needs openai``, ``out of time``);
the report is that process's JUnit XML, or ``-``. A module whose process left no report
(killed, crashed at start) shows its exit status and counts nothing.

Prints the table first (one row per module: status, passed, failed, errors, skipped,
seconds, note; then the totals), then one line per failed or erroring test with the
first line of its message. Exits 1 when any test failed or erred, or any module that
ran gave no report or a bad exit status; else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

OUTCOMES = ("passed", "failed", "errors", "skipped")
OK_STATUS = {"0", "5"}  # pytest: all passed; no test selected
KILLED = {"124": "timed out", "137": "killed", "2": "interrupted", "3": "internal error",
          "4": "usage error"}  # fmt: skip


@dataclass
class Module:
    module: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float | None = None
    status: str | None = None  # the process's exit status, "-" when it did not run
    note: str = ""
    failures: list[dict[str, str]] = field(default_factory=list)

    def verdict(self) -> str:
        """ok, FAIL, NOT RUN, or how the process ended (TIMED OUT, KILLED, ...)."""
        if self.status == "-":
            return "NOT RUN"
        if self.failed or self.errors:
            return "FAIL"
        if self.status in KILLED:
            return KILLED[self.status].upper()
        return "ok" if self.status is None or self.status in OK_STATUS else "FAIL"

    @property
    def bad(self) -> bool:
        return self.verdict() not in ("ok", "NOT RUN")


def module_of(case: ET.Element) -> str:
    """The test file of a ``<testcase>``: its ``file`` attribute (junit_family=xunit1), or
    its dotted class name less any class (a collection error names the module instead)."""
    if case.get("file"):
        return str(case.get("file"))
    dotted = case.get("classname") or case.get("name") or "?"
    parts = dotted.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():  # TestSomething
        parts.pop()
    return "/".join(parts) + ".py"


def _test_id(case: ET.Element, module: str) -> str:
    if not case.get("classname"):  # a collection error: the module itself
        return f"{module} (collection)"
    return f"{module}::{case.get('name')}"


def _message(node: ET.Element) -> str:
    """The first line of a failure's message; for a collection error, whose message is
    only "collection failure", the exception's line of the traceback."""
    msg = (node.get("message") or "").strip()
    if msg and msg != "collection failure":
        return msg.splitlines()[0]
    raised = [ln[1:].strip() for ln in (node.text or "").splitlines() if ln.startswith("E ")]
    return raised[-1] if raised else msg


def read_report(path: Path) -> dict[str, Module]:
    """The counts and failures of one JUnit XML file, by module."""
    out: dict[str, Module] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = module_of(case)
        m = out.setdefault(name, Module(name, seconds=0.0))
        m.seconds = (m.seconds or 0.0) + float(case.get("time") or 0.0)
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            if tag == "failure":
                m.failed += 1
            else:
                m.errors += 1
            node = case.find(tag)
            assert node is not None
            m.failures.append(
                {"test": _test_id(case, name), "kind": tag, "message": _message(node)}
            )
        elif "skipped" in kinds:
            m.skipped += 1
        else:
            m.passed += 1
    return out


def from_reports(paths: list[Path]) -> list[Module]:
    merged: dict[str, Module] = {}
    for p in paths:
        for name, m in read_report(p).items():
            if name not in merged:
                merged[name] = m
                continue
            t = merged[name]
            for k in OUTCOMES:
                setattr(t, k, getattr(t, k) + getattr(m, k))
            t.seconds = (t.seconds or 0.0) + (m.seconds or 0.0)
            t.failures += m.failures
    return sorted(merged.values(), key=lambda m: m.module)


def from_manifest(path: Path) -> list[Module]:
    """One row per manifest line, in its order (see the module docstring)."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        cols = (line.split("\t") + [""] * 5)[:5]
        name, status, report, seconds, note = (c.strip() for c in cols)
        m = Module(name, status=status or None, note=note)
        m.seconds = float(seconds) if seconds not in ("", "-") else None
        rp = Path(report) if report not in ("", "-") else None
        if rp is not None and rp.is_file() and rp.stat().st_size:
            try:
                for part in read_report(rp).values():
                    for k in OUTCOMES:
                        setattr(m, k, getattr(m, k) + getattr(part, k))
                    m.failures += part.failures
            except ET.ParseError as e:
                m.note = (m.note + "; " if m.note else "") + f"unreadable report: {e}"
                m.status = m.status if m.status not in OK_STATUS else "3"
        elif status != "-":
            m.note = (m.note + "; " if m.note else "") + "no report"
            if m.status in OK_STATUS:  # ran, yet wrote nothing: not a pass
                m.status = "3"
        rows.append(m)
    return rows


def format_table(rows: list[Module]) -> str:
    width = max([len(r.module) for r in rows] + [len("module")])
    head = f"{'module':<{width}}  {'status':<9}{'pass':>6}{'fail':>6}{'err':>6}{'skip':>6}{'s':>8}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        secs = "-" if r.seconds is None else f"{r.seconds:.1f}"
        note = r.note
        if r.status not in (None, "-") and r.status not in OK_STATUS | {"1"}:
            note = f"exit {r.status}" + (f"; {note}" if note else "")
        lines.append(
            f"{r.module:<{width}}  {r.verdict():<9}{r.passed:>6}{r.failed:>6}{r.errors:>6}"
            f"{r.skipped:>6}{secs:>8}  {note}".rstrip()
        )
    tot = {k: sum(getattr(r, k) for r in rows) for k in OUTCOMES}
    bad = sum(r.bad for r in rows)
    idle = sum(r.verdict() == "NOT RUN" for r in rows)
    title = f"total ({len(rows)} modules, {bad} not ok, {idle} not run)"
    lines.append("-" * len(head))
    lines.append(
        f"{title:<{width}}  {'':<9}{tot['passed']:>6}"
        f"{tot['failed']:>6}{tot['errors']:>6}{tot['skipped']:>6}"
    )
    for r in rows:
        for f in r.failures:
            kind = "FAILED" if f["kind"] == "failure" else "ERROR"
            lines.append(f"{kind} {f['test']}: {f['message'][:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="*", type=Path, help="JUnit XML files")
    ap.add_argument("--manifest", type=Path, help="one line per module run (see above)")
    ap.add_argument("--json", type=Path, help="write the rows and totals here")
    args = ap.parse_args(argv)
    if (args.manifest is None) == (not args.reports):
        ap.error("give JUnit XML reports or --manifest (one of the two)")
    rows = from_manifest(args.manifest) if args.manifest else from_reports(args.reports)
    print(format_table(rows), flush=True)
    bad = [r for r in rows if r.bad]
    if args.json is not None:
        data = {
            "modules": [{**asdict(r), "verdict": r.verdict()} for r in rows],
            "totals": {k: sum(getattr(r, k) for r in rows) for k in OUTCOMES},
            "not_ok": [r.module for r in bad],
            "not_run": [r.module for r in rows if r.verdict() == "NOT RUN"],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
