"""``pdserve soak`` against a real ``pdserve serve`` on the tiny checkpoint (CPU, 127.0.0.1):
it reports a leak planted in the API server (``PDSERVE_TEST_LEAK_BYTES_PER_REQUEST``,
20 KB per request) and passes the same run without it.

The threshold is set well above what a fresh server shows while it settles (about
1 KiB per request over its first few hundred requests) and well below the plant.
Concurrency is capped so that no backlog builds up inside the server, which would look
like growth too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.conftest import start_server
from pdserve.cli import main as cli_main
from pdserve.serving.api.leak_plant import ENV

LEAK_BYTES = 20_000
THRESHOLD_KB_PER_1K = 4096  # 4 KiB per request; the plant is ~19.5 KiB per request


def _soak(url: str, tokenizer: Path, out: Path) -> tuple[int, dict[str, dict[str, object]]]:
    rc = cli_main(
        ["soak", "--base-url", url, "--tokenizer", str(tokenizer), "--num-requests", "600",
         "--request-rate", "400", "--max-concurrency", "16", "--random-input-len", "16",
         "--random-output-len", "2", "--warmup-requests", "80", "--sample-interval-s", "0.15",
         "--leak-threshold-kb-per-1k", str(THRESHOLD_KB_PER_1K), "--disable-tqdm",
         "--result-dir", str(out)]
    )  # fmt: skip
    (summary,) = out.glob("soak-*.json")
    res = json.loads(summary.read_text())
    assert res["completed"] == 600 and res["failed"] == 0
    by_process = {str(r["process"]).rsplit(" ", 1)[1]: r for r in res["processes"]}
    return rc, by_process


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_catches_a_planted_leak_and_passes_without(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = start_server(tiny_llama, tmp_path, "--max-model-len", "256")
    try:
        rc, procs = _soak(srv.url, tiny_llama, tmp_path / "clean")
    finally:
        srv.stop()
    assert set(procs) == {"api_server", "engine_core"}
    assert rc == 0, procs
    assert all(p["verdict"] == "ok" for p in procs.values()), procs

    monkeypatch.setenv(ENV, str(LEAK_BYTES))  # read by the server started next
    srv = start_server(tiny_llama, tmp_path, "--max-model-len", "256")
    try:
        rc, procs = _soak(srv.url, tiny_llama, tmp_path / "leaky")
    finally:
        srv.stop()
    assert rc == 1
    assert procs["api_server"]["verdict"] == "leak"
    low = float(procs["api_server"]["steady_ci95_low_kb_per_1k"])  # type: ignore[arg-type]
    assert low > THRESHOLD_KB_PER_1K
    assert procs["engine_core"]["verdict"] == "ok"


def test_leak_plant_is_refused_outside_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import FastAPI

    from pdserve.serving.api.leak_plant import install_leak_plant

    app = FastAPI()
    install_leak_plant(app)  # unset: nothing happens
    monkeypatch.setenv(ENV, "100")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    with pytest.raises(ValueError, match="test-only"):
        install_leak_plant(app)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(ValueError, match="must be an integer"):
        install_leak_plant(app)
