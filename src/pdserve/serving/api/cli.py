"""``pdserve serve MODEL_DIR``: one instance = an API server process + an engine-core process.

Flags keep ``vllm serve``'s names where the meaning is the same. A vLLM flag that
pdserve does not support yet is accepted by the parser only to be refused with a
message that says so, so a user never gets a silently different server.

The P/D secret comes from the environment (``PDSERVE_PD_SECRET``, never a flag: a
command line is visible to every user of the host); without it the instance refuses
every ``kv_transfer_params`` (403).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve.config import EngineConfig, add_engine_args
from pdserve.core_types.pd_auth import load_secret
from pdserve.frontend.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from pdserve.heap import freeze_startup_heap
from pdserve.serving import conn_limits
from pdserve.serving.api.chat_output import OutputParsing
from pdserve.serving.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES

logger = logging.getLogger(__name__)

# vLLM flags a user may carry over, each refused with the reason.
UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--enable-lora": "LoRA adapters are not supported",
    "--pipeline-parallel-size": "pipeline parallelism is not supported",
    "--tokenizer-mode": "pdserve always uses the fast tokenizer from tokenizer.json",
    "--trust-remote-code": "pdserve runs no code from model folders",
    "--all2all-backend": (
        "expert parallelism moves tokens with pdserve's own dispatchers (all-to-all in eager "
        "steps, all-gather under CUDA graphs: pdserve.layers.moe_dispatch); there is no "
        "backend to choose"
    ),
    "--fingerprint-mode": "answers carry no system_fingerprint (null), so it has no mode",
    "--fingerprint-value": "answers carry no system_fingerprint (null), so it has no value",
}


class _Refuse(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} is not supported by pdserve: {UNSUPPORTED_VLLM_FLAGS[option_string or '']}"
        )


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) the API answers to (default: the model path)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint except /health, "
        "/metrics, /version and the OpenAPI docs",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=_body_limit,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="answer 413 to a request body larger than this, before reading it; 0 for no "
        f"limit (default {DEFAULT_MAX_REQUEST_BODY_BYTES} = 32 MiB: about 4 million prompt "
        "token ids)",
    )
    conn_limits.add_cli_args(p)
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--chat-template", default=None, help="a Jinja chat template (file path or string)"
    )
    p.add_argument(
        "--chat-template-content-format", default="auto", choices=["auto", "string", "openai"]
    )
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access log line per HTTP request (it is on by default, at INFO level on "
        "the uvicorn.access logger, whatever --uvicorn-log-level says)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=list(REASONING_PARSERS),
        help="split <think>...</think> output into reasoning_content and content",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls out of chat output when a request has tools and "
        "tool_choice 'auto' (needs --tool-call-parser)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="the tool-call format the model writes",
    )
    p.add_argument(
        "--metrics-vllm-aliases",
        action="store_true",
        help="also export the key /metrics series under vLLM's vllm: names",
    )
    for flag in UNSUPPORTED_VLLM_FLAGS:
        try:
            p.add_argument(flag, nargs="?", action=_Refuse, help=argparse.SUPPRESS)
        except argparse.ArgumentError:  # the engine's flags implement it now
            continue
    p.set_defaults(func=main)


def _body_limit(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: no limit)")
    return n


async def serve(args: argparse.Namespace) -> int:
    from pdserve.frontend.async_client import AsyncEngineClient
    from pdserve.metrics.prometheus import PrometheusMetrics
    from pdserve.serving.api.app import build_app
    from pdserve.serving.api.server import serve_app

    config = EngineConfig.from_cli(args)
    limits = conn_limits.from_args(args)
    # refuse bad parser settings before the engine starts
    OutputParsing(args.reasoning_parser, args.tool_call_parser, args.enable_auto_tool_choice)
    pd_secret = load_secret()  # ValueError (a too-short secret) before anything starts
    if pd_secret is None:
        logger.info("no P/D secret (PDSERVE_PD_SECRET): kv_transfer_params will be refused")
    engine = await AsyncEngineClient.start(config, log_level=args.log_level)
    try:
        ready = engine.ready
        assert ready is not None
        logger.info(
            "engine ready in %.1fs on %s (%d KV blocks)",
            ready.startup_seconds,
            ready.device,
            ready.num_blocks,
        )
        metrics = PrometheusMetrics(
            (args.served_model_name or [args.model])[0],
            stats_provider=engine.latest_stats,
            max_model_len=engine.max_model_len,
            vllm_aliases=args.metrics_vllm_aliases,
        )
        engine.on_stats = metrics.observe_stats
        app = build_app(
            engine,
            metrics=metrics,
            served_model_names=args.served_model_name or [args.model],
            api_key=args.api_key,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            chat_template=args.chat_template,
            chat_template_content_format=args.chat_template_content_format,
            pd_secret=pd_secret,
            max_request_body_bytes=args.max_request_body_bytes or None,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
        )
        freeze_startup_heap()
        print(f"pdserve: serving {args.model} on http://{args.host}:{args.port}", flush=True)
        await serve_app(
            app,
            args.host,
            args.port,
            args.shutdown_timeout,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            limits=limits,
        )
    finally:
        await engine.shutdown()
    return 0


def main(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))
