"""Soak an API server and report its RSS over the run (not a test: run it by hand).

    .venv/bin/python tests/serving/_soak.py --requests 30000            # fake engine
    .venv/bin/python tests/serving/_soak.py --url http://127.0.0.1:8100  # any server

Without ``--url`` it starts the app on conftest's fake engine in a process of its own
(``_proc_server``). Each request is a prefill leg as the P/D proxy sends it (signed
``{"do_remote_decode": true}``, ``max_tokens=1``) unless ``--plain``; ``--concurrency``
clients share keep-alive connections unless ``--new-connections``. Prints
``requests rss_kib`` every ``--every`` requests, then the growth per request over the
second half of the run (the first half warms caches and allocator arenas up).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc_server import ProcServer, _status_kib  # noqa: E402

from pdserve.core_types.pd_auth import SECRET_ENV, load_secret, new_secret, sign_kv_params  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=None)
    p.add_argument("--pid", type=int, default=None, help="server pid (with --url)")
    p.add_argument("--requests", type=int, default=30_000)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--every", type=int, default=2000)
    p.add_argument("--plain", action="store_true", help="no kv_transfer_params")
    p.add_argument("--unsigned", action="store_true", help="kv_transfer_params unsigned")
    p.add_argument("--new-connections", action="store_true")
    p.add_argument("--model", default="fake-model")
    args = p.parse_args()
    os.environ.setdefault(SECRET_ENV, new_secret())
    secret = load_secret()
    assert secret is not None
    server = None
    if args.url is None:
        server = ProcServer()
        url, pid = server.url, server.pid
    else:
        url, pid = args.url, args.pid
    counter = {"sent": 0, "errors": 0}
    lock = threading.Lock()
    samples: list[tuple[int, int]] = []

    host, _, port = url.removeprefix("http://").partition(":")
    headers = {"Content-Type": "application/json"}

    def client() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            while True:
                with lock:
                    if counter["sent"] >= args.requests:
                        return
                    counter["sent"] += 1
                    n = counter["sent"]
                body: dict = {"model": args.model, "prompt": f"soak {n} hello", "max_tokens": 1}
                rid = f"soak-{n}"
                if not args.plain:
                    kv = {"do_remote_decode": True}
                    signed = sign_kv_params(kv, secret, request_id=rid)
                    body["kv_transfer_params"] = kv if args.unsigned else signed
                conn.request(
                    "POST",
                    "/v1/completions",
                    body=json.dumps(body),
                    headers={**headers, "X-Request-Id": rid},
                )
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    with lock:
                        counter["errors"] += 1
                if args.new_connections:
                    conn.close()
                if pid is not None and n % args.every == 0:
                    samples.append((n, _status_kib(pid, "VmRSS")))
                    print(n, samples[-1][1], flush=True)
        finally:
            conn.close()

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    print(f"{args.requests} requests in {elapsed:.0f} s, {counter['errors']} errors")
    if len(samples) >= 4:
        samples.sort()
        half = samples[len(samples) // 2 :]
        (n0, r0), (n1, r1) = half[0], half[-1]
        print(
            f"RSS {samples[0][1]} -> {samples[-1][1]} KiB; second half: "
            f"{(r1 - r0) * 1024 / max(1, n1 - n0):.1f} bytes/request"
        )
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
