"""``pdserve proxy``: flags and entry point of the P/D proxy (the app is
:func:`pdserve.serving.proxy.app.build_proxy_app`).

``--prefill URL... --decode URL...`` routes each request through a prefill and a decode
instance; ``--colocated URL...`` (instead: the two kinds are not mixed) sends each
request whole to the least-loaded healthy colocated instance (no ``kv_role``, or
``kv_both``).

:func:`main` builds the app and serves it with the shared
:class:`~pdserve.serving.uvicorn_server.UvicornServer` until SIGTERM/SIGINT: uvicorn
stops accepting, lets in-flight requests finish for at most ``--shutdown-timeout``
seconds (then cancels them, which aborts their upstream legs), and :func:`main`
returns 0. A second signal stops at once.

A P/D proxy needs the topology's secret in ``PDSERVE_PD_SECRET`` (to sign the legs'
``kv_transfer_params``); without it :func:`main` exits 2 saying so. A colocated proxy
signs nothing and does not need it. ``pdserve launch``
passes it, and any of these flags through the topology's ``proxy: args``.
``python -m pdserve.serving.proxy`` runs the same command without the rest of the
``pdserve`` CLI.

Client-side limits are the instances' (``--max-request-body-bytes``, ``--header-timeout``,
``--body-timeout``, ``--max-idle-connections``; :mod:`pdserve.serving.body_limit`,
:mod:`pdserve.serving.conn_limits`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from fastapi import FastAPI

from pdserve.heap import freeze_startup_heap
from pdserve.serving import conn_limits
from pdserve.serving.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from pdserve.serving.conn_limits import ConnectionLimits, positive_count
from pdserve.serving.proxy.app import build_proxy_app
from pdserve.serving.proxy.core import ProxyCore
from pdserve.serving.uvicorn_server import UvicornServer


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _seconds_or_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve proxy``; sets ``func=main``."""
    p.add_argument(
        "--prefill", nargs="+", default=[], metavar="URL", help="prefill instance URL(s)"
    )
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instance URL(s)")
    p.add_argument(
        "--colocated",
        nargs="+",
        default=[],
        metavar="URL",
        help="colocated instance URL(s), instead of --prefill/--decode: each request goes "
        "whole to the least-loaded healthy one",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument(
        "--upstream-api-key",
        default=None,
        help="send this key to the instances (default: forward the client's Authorization)",
    )
    p.add_argument(
        "--health-interval", type=_seconds, default=2.0, help="seconds between health probes"
    )
    p.add_argument(
        "--spec-scrape-interval",
        type=_seconds,
        default=10.0,
        help="seconds between reads of each instance's /metrics for the per-pool "
        "speculative-decoding series (pdserve:proxy_spec_decode_*)",
    )
    p.add_argument(
        "--health-timeout",
        type=_seconds,
        default=2.0,
        help="seconds a health probe may take before it counts as a failure",
    )
    p.add_argument(
        "--failure-threshold",
        type=positive_count,
        default=3,
        help="consecutive failures (probes or legs) that mark an instance down (default 3)",
    )
    p.add_argument(
        "--queue-timeout",
        type=_seconds_or_zero,
        default=30.0,
        help="seconds a request waits for an instance when a pool has none healthy "
        "(e.g. while one restarts); then 503. 0: answer 503 at once",
    )
    p.add_argument(
        "--request-timeout",
        type=_seconds,
        default=600.0,
        help="seconds a non-streaming leg may take, and the longest gap within a stream",
    )
    p.add_argument(
        "--connect-timeout", type=_seconds, default=10.0, help="seconds to connect upstream"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=_bytes_or_zero,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="answer 413 to a request body larger than this, before reading it; 0 for no "
        f"limit (default {DEFAULT_MAX_REQUEST_BODY_BYTES} = 32 MiB, as on the instances)",
    )
    conn_limits.add_cli_args(p)
    p.add_argument("--uvicorn-log-level", default="warning")
    p.set_defaults(func=main)


def _bytes_or_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: no limit), got {text}")
    return value


async def serve_proxy(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    shutdown_timeout: float = 30.0,
    log_level: str = "warning",
    limits: ConnectionLimits | None = None,
) -> int:
    """Serve ``app`` until SIGTERM/SIGINT (see the module docstring); 0 after a clean
    stop, 1 if the port cannot be bound or the app fails to start."""
    server = UvicornServer(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(shutdown_timeout),
        limits=limits,
    )
    try:
        server.bind()
    except OSError as e:
        print(f"pdserve proxy: cannot bind {host}:{port}: {e}", file=sys.stderr)
        return 1
    core: ProxyCore = app.state.proxy
    pools = ", ".join(f"{p.role} {[i.url for i in p.instances]}" for p in core.pools)
    print(f"pdserve proxy: http://{host}:{server.port} -> {pools}", flush=True)
    await server.serve()
    return 0 if server.started.is_set() else 1


def main(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve proxy``; returns the process exit status."""
    try:
        app = build_proxy_app(
            args.prefill,
            args.decode,
            colocated_urls=getattr(args, "colocated", []),
            api_key=args.api_key,
            upstream_api_key=args.upstream_api_key,
            health_interval=args.health_interval,
            spec_scrape_interval=getattr(args, "spec_scrape_interval", 10.0),
            health_timeout=getattr(args, "health_timeout", 2.0),
            failure_threshold=getattr(args, "failure_threshold", 3),
            queue_timeout=getattr(args, "queue_timeout", 30.0),
            request_timeout=args.request_timeout,
            connect_timeout=getattr(args, "connect_timeout", 10.0),
            max_request_body_bytes=getattr(args, "max_request_body_bytes", None) or None,
        )
        limits = conn_limits.from_args(args)
    except ValueError as e:
        print(f"pdserve proxy: error: {e}", file=sys.stderr)
        return 2
    freeze_startup_heap()
    return asyncio.run(
        serve_proxy(
            app,
            args.host,
            args.port,
            shutdown_timeout=getattr(args, "shutdown_timeout", 30.0),
            log_level=getattr(args, "uvicorn_log_level", "warning"),
            limits=limits,
        )
    )
