"""A fake prefill or decode instance served by pdserve's production uvicorn runner.

``python fake_instance.py prefill|decode [--port 0] [--keep-alive S] [--delay S]
[--chunks N] [--chunk-delay S] [--no-verify]`` prints ``PORT <n>`` once bound and serves
until SIGTERM.

Unlike the in-process aiohttp fakes of ``conftest.py`` this one runs in its own process
(so a test can SIGSTOP or SIGKILL it) behind
:class:`~pdserve.serving.uvicorn_server.UvicornServer` with its production settings
(keep-alive included, unless ``--keep-alive`` overrides it, e.g. to 5 s: stock
uvicorn's, which vLLM instances use). Like a real instance it verifies the
``kv_transfer_params`` of every leg with the topology's secret (``PDSERVE_PD_SECRET``)
and answers 403 to unsigned ones. ``GET /stats`` returns its counters, among them
``connections``: how many TCP connections its clients opened (each closed keep-alive
connection means one more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.core_types.pd_auth import NonceCache, SignatureError, load_secret, verify_kv_params
from pdserve.serving.uvicorn_server import UvicornServer


def build_app(role: str, *, delay: float, chunks: int, chunk_delay: float, verify: bool) -> FastAPI:
    app = FastAPI()
    stats = {"requests": 0, "verified": 0, "rejected": 0, "released": 0, "health": 0}
    peers: set[Any] = set()
    secret = load_secret()
    nonces = NonceCache()
    rng = random.Random(os.getpid())

    @app.middleware("http")
    async def count_connections(request: Request, call_next: Any) -> Response:
        if request.url.path != "/stats":
            peers.add(request.client)
        return await call_next(request)  # type: ignore[no-any-return]

    @app.get("/health")
    async def health() -> Response:
        stats["health"] += 1
        return Response(status_code=200)

    @app.get("/stats")
    async def get_stats() -> JSONResponse:
        return JSONResponse({**stats, "connections": len(peers)})

    @app.post("/v1/kv_transfer/release")
    async def release(request: Request) -> JSONResponse:
        body = await request.json()
        if verify:
            try:
                assert secret is not None, "PDSERVE_PD_SECRET is not set"
                verify_kv_params(body, secret, nonces=nonces)
            except SignatureError:
                stats["rejected"] += 1
                return JSONResponse({}, status_code=403)
        stats["released"] += 1
        return JSONResponse({})

    async def completion(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        stats["requests"] += 1
        rid = request.headers.get("x-request-id", "none")
        if "kv_transfer_params" in body and verify:
            try:
                assert secret is not None, "PDSERVE_PD_SECRET is not set"
                verify_kv_params(body["kv_transfer_params"], secret, request_id=rid, nonces=nonces)
            except SignatureError as e:
                stats["rejected"] += 1
                err = {"message": str(e), "type": "PermissionError", "param": None, "code": 403}
                return JSONResponse({"error": err}, status_code=403)
            stats["verified"] += 1
        if delay:
            await asyncio.sleep(rng.uniform(0.5 * delay, 1.5 * delay))
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        out: dict[str, Any] = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0,
                               "model": "fake", "choices": [choice]}  # fmt: skip
        if role == "prefill":
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_request_id": rid,
                "remote_block_ids": [1, 2, 3],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            }
            return JSONResponse(out)
        if not body.get("stream"):
            return JSONResponse(out)

        async def events() -> Any:
            for i in range(chunks):
                if i:
                    await asyncio.sleep(chunk_delay)
                yield (
                    b"data: "
                    + json.dumps(dict(out, choices=[dict(choice, text=f"t{i}")])).encode()
                    + b"\n\n"
                )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/completions", completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", completion, methods=["POST"])
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--keep-alive", type=float, default=None)
    p.add_argument("--delay", type=float, default=0.0, help="mean seconds per completion")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk-delay", type=float, default=0.005)
    p.add_argument("--no-verify", action="store_true")
    a = p.parse_args()
    app = build_app(
        a.role, delay=a.delay, chunks=a.chunks, chunk_delay=a.chunk_delay, verify=not a.no_verify
    )
    kwargs = {} if a.keep_alive is None else {"timeout_keep_alive": a.keep_alive}
    server = UvicornServer(app, host="127.0.0.1", port=a.port, log_level="warning", **kwargs)
    server.bind()
    print(f"PORT {server.port}", flush=True)
    asyncio.run(server.serve())
    sys.exit(0)


if __name__ == "__main__":
    main()
