"""A stand-in for ``pdserve serve`` / ``pdserve proxy`` in the launcher tests.

``python fake_server.py serve|proxy ... --host H --port P ...``: answers ``GET /health``
with 200 (after ``FAKE_READY_DELAY`` seconds), appends JSON events (start, ready, term,
grandchild) to ``$FAKE_RECORD_DIR/<kind>-<port>.jsonl``, exits 0 on SIGTERM unless
``FAKE_IGNORE_TERM=1``, exits 3 after ``FAKE_EXIT_AFTER`` seconds if set, and with
``FAKE_GRANDCHILD=1`` leaves a sleeping child behind in its process group (as an
engine-core process would be). A run that finds an earlier ``start`` in its record file
(a restart) waits ``FAKE_RESTART_READY_DELAY`` seconds (if set) instead of
``FAKE_READY_DELAY``. The start event records the environment variables named
``FAKE_*``, ``CUDA_*``, ``PYTHON*`` and ``PDSERVE_PD_SECRET``.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    kind, argv = sys.argv[1], sys.argv[2:]
    host = argv[argv.index("--host") + 1]
    port = int(argv[argv.index("--port") + 1])
    record = Path(os.environ["FAKE_RECORD_DIR"]) / f"{kind}-{port}.jsonl"
    lock = threading.Lock()
    restarted = record.exists() and '"event": "start"' in record.read_text()

    def log(event: str, **kw: object) -> None:
        with lock, open(record, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\n")

    log(
        "start",
        argv=argv,
        pid=os.getpid(),
        env={
            k: v
            for k, v in os.environ.items()
            if k.startswith(("FAKE_", "CUDA_", "PYTHON", "PDSERVE_PD_SECRET"))
        },
    )
    if os.environ.get("FAKE_GRANDCHILD") == "1":
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        log("grandchild", pid=g.pid)

    def on_term(signum: int, frame: object) -> None:
        log("term")
        if os.environ.get("FAKE_IGNORE_TERM") != "1":
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    delay = os.environ.get("FAKE_READY_DELAY", "0")
    if restarted:
        delay = os.environ.get("FAKE_RESTART_READY_DELAY", delay)
    ready_at = time.monotonic() + float(delay)
    exit_after = os.environ.get("FAKE_EXIT_AFTER")
    if exit_after:
        threading.Timer(float(exit_after), lambda: os._exit(3)).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and time.monotonic() >= ready_at
            if ok and not getattr(server, "ready_logged", False):
                server.ready_logged = True  # type: ignore[attr-defined]
                log("ready")
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    print(f"fake {kind} on {host}:{port}", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
