"""The API app with a fake engine in a process of its own, for what must be measured on
the server process alone (RSS, peak RSS) and for soaks.

``ProcServer(...)`` starts ``python _proc_server.py ARGS`` (this file as a script: it
builds the app on conftest's fake engine, serves it on 127.0.0.1:<ephemeral> and prints
the port) and stops it with SIGTERM. The fake engine forgets finished requests, so a
soak measures the app, not the fake.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class ProcServer:
    """A fake-engine API server in a child process (loopback, ephemeral port)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr!r}")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not become healthy")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        return _status_kib(self.pid, "VmRSS")

    def peak_rss_kib(self) -> int:
        return _status_kib(self.pid, "VmHWM")

    def reset_peak_rss(self) -> bool:
        """Reset VmHWM to the current RSS (Linux ``clear_refs``); False if not allowed."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    def stop(self) -> str:
        """SIGTERM, wait; returns the server's stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=5)
        return err or ""

    def __enter__(self) -> ProcServer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _serve(argv: list[str]) -> None:
    import asyncio

    sys.path[:0] = [str(SRC), str(HERE)]
    from conftest import MODEL, FakeEngineClient  # type: ignore[import-not-found]
    from pdserve.core_types.pd_auth import load_secret
    from pdserve.serving.api.app import build_app
    from pdserve.serving.api.server import ApiServer

    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default=None, help="a model folder (default: the fake)")
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-request-body-bytes", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--token-delay", type=float, default=0.0)
    args = p.parse_args(argv)

    class LeanEngine(FakeEngineClient):  # type: ignore[misc]
        def generate(self, request_id: str, *a: Any, **kw: Any) -> Any:
            out = super().generate(request_id, *a, **kw)
            self.requests.pop(request_id, None)
            return out

    tok = None
    if args.tokenizer:
        from pdserve.frontend.tokenizer import Tokenizer

        tok = Tokenizer.from_pretrained(args.tokenizer)
    engine = LeanEngine(tok, max_model_len=args.max_model_len, token_delay=args.token_delay)
    kwargs: dict[str, Any] = {"api_key": args.api_key, "pd_secret": load_secret()}
    if args.max_request_body_bytes is not None:
        kwargs["max_request_body_bytes"] = args.max_request_body_bytes or None
    app = build_app(engine, served_model_names=[MODEL], **kwargs)
    server = ApiServer(app, host="127.0.0.1", port=0, shutdown_timeout=5, log_level="warning")
    server.bind()
    print(server.port, flush=True)
    asyncio.run(server.serve())


if __name__ == "__main__":
    _serve(sys.argv[1:])
