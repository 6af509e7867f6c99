"""benchmarks/pytest_table.py: the per-module table of the GPU test stage, from JUnit XML
that a real pytest run wrote (passes, a failure, an error in a fixture, a skip, a
collection error), and from a manifest with a module killed by its timeout and one not
run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import load_script

MIXED = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_ok():
    pass

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1, "x is not one"

def test_uses_broken(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

class TestGroup:
    def test_in_class(self):
        pass
"""


def _pytest(tmp: Path, report: Path, *args: str) -> int:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    cmd.append(f"--junitxml={report}")
    return subprocess.run(cmd, cwd=tmp, capture_output=True, timeout=120).returncode


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(mixed + broken modules, default JUnit family; a passing module, xunit1)."""
    tmp = tmp_path_factory.mktemp("runs")
    pkg = tmp / "tests" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "test_mixed.py").write_text(MIXED)
    (pkg / "test_broken.py").write_text("import no_such_module_here\n")
    (pkg / "test_fine.py").write_text("def test_a():\n    pass\n")
    mixed, fine = tmp / "mixed.xml", tmp / "fine.xml"
    both = ["tests/kernels/test_mixed.py", "tests/kernels/test_broken.py"]
    assert _pytest(tmp, mixed, *both, "--continue-on-collection-errors") == 1
    xunit1 = ["-o", "junit_family=xunit1"]  # testcases carry their file
    assert _pytest(tmp, fine, "tests/kernels/test_fine.py", *xunit1) == 0
    return mixed, fine


def test_table_from_reports_and_a_manifest(
    reports: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = load_script("pytest_table")
    mixed, fine = reports
    rows = {r.module: r for r in table.from_reports([mixed, fine])}
    m = rows["tests/kernels/test_mixed.py"]
    assert (m.passed, m.failed, m.errors, m.skipped) == (3, 1, 1, 1)
    assert m.verdict() == "FAIL"
    msgs = {f["test"]: f["message"] for f in m.failures}
    assert "x is not one" in msgs["tests/kernels/test_mixed.py::test_param[2]"]
    assert "fixture broke" in msgs["tests/kernels/test_mixed.py::test_uses_broken"]
    b = rows["tests/kernels/test_broken.py"]  # a collection error names the module
    assert b.errors == 1 and "no_such_module_here" in b.failures[0]["message"]
    assert b.failures[0]["test"] == "tests/kernels/test_broken.py (collection)"
    assert rows["tests/kernels/test_fine.py"].passed == 1

    manifest = tmp_path / "manifest.tsv"
    manifest.write_text(
        f"tests/kernels/test_mixed.py\t1\t{mixed}\t4.2\t\n"
        "tests/kernels/test_slow.py\t124\t-\t180.0\t\n"  # killed: no report
        "tests/serving/test_api_openai.py\t-\t-\t-\tneeds openai (not installed)\n"
    )
    out = tmp_path / "tests.json"
    assert table.main(["--manifest", str(manifest), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("module") and "status" in lines[0]
    row = {ln.split()[0]: ln.split() for ln in lines[2:5]}
    # the manifest's module row counts the whole report (mixed and broken)
    assert row["tests/kernels/test_mixed.py"][1:7] == ["FAIL", "3", "1", "2", "1", "4.2"]
    assert row["tests/kernels/test_slow.py"][1:3] == ["TIMED", "OUT"]
    assert "exit 124; no report" in text
    assert row["tests/serving/test_api_openai.py"][1:3] == ["NOT", "RUN"]
    assert "total (3 modules, 2 not ok, 1 not run)" in text
    assert "FAILED tests/kernels/test_mixed.py::test_param[2]" in text
    assert "ERROR tests/kernels/test_mixed.py::test_uses_broken" in text
    data = json.loads(out.read_text())
    assert data["totals"] == {"passed": 3, "failed": 1, "errors": 2, "skipped": 1}
    assert data["not_ok"] == ["tests/kernels/test_mixed.py", "tests/kernels/test_slow.py"]
    assert data["not_run"] == ["tests/serving/test_api_openai.py"]


def test_all_passing_exits_zero_and_no_input_is_refused(
    reports: tuple[Path, Path], tmp_path: Path
) -> None:
    table = load_script("pytest_table")
    fine = reports[1]
    manifest = tmp_path / "m.tsv"
    manifest.write_text(f"tests/kernels/test_fine.py\t0\t{fine}\t0.5\t\n")
    assert table.main(["--manifest", str(manifest)]) == 0
    assert table.main([str(fine)]) == 0
    manifest.write_text("tests/kernels/test_fine.py\t0\t-\t0.5\t\n")  # exit 0, no report
    assert table.main(["--manifest", str(manifest)]) == 1
    with pytest.raises(SystemExit):
        table.main([])
