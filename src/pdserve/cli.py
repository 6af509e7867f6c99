"""``pdserve`` command line: one subcommand per process role.

Subcommands import their modules lazily so that ``pdserve --help`` and the light
commands (bench) start fast and need no torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config import EngineConfig


def _add_make_checkpoint(sub: argparse._SubParsersAction) -> None:
    from pdserve.testing import checkpoint

    p = sub.add_parser("make-checkpoint", help="write a random-initialised HF checkpoint")
    checkpoint.add_cli_args(p)
    p.set_defaults(func=checkpoint.main)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from pdserve.config import add_engine_args

    p = sub.add_parser("generate", help="offline generation from a model folder")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from pdserve.config import EngineConfig
    from pdserve.core_types.sampling_params import SamplingParams
    from pdserve.frontend.llm import LLM

    cfg = EngineConfig.from_cli(args)
    t0 = time.perf_counter()
    llm = LLM(cfg.model.model, **_flat(cfg))
    t1 = time.perf_counter()
    sp = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        outs = llm.generate(args.prompt, sp)
    finally:  # tensor-parallel followers leave cleanly, their temp dir goes
        llm.shutdown()
    t2 = time.perf_counter()
    ntok = 0
    for o in outs:
        c = o.outputs[0]
        ntok += len(c.token_ids)
        print(f"prompt ({len(o.prompt_token_ids)} tokens): {o.prompt!r}")
        print(f"output ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}): {c.text!r}\n")
    print(
        f"loaded in {t1 - t0:.2f}s; generated {ntok} tokens in {t2 - t1:.2f}s on {llm.engine.runner.device}"
    )
    return 0


def _flat(cfg: EngineConfig) -> dict[str, Any]:
    """``LLM`` keyword arguments that rebuild ``cfg``: the flat fields of the plain
    sections, and every other part (compilation, KV transfer, speculative decoding, ...)
    as its config object under ``<part>_config``. (``dataclasses.asdict`` cannot take
    those: they may be ``None``.)"""
    import dataclasses

    out: dict[str, Any] = {}
    for part in dataclasses.fields(cfg):
        value = getattr(cfg, part.name)
        if part.name in cfg.SECTIONS:
            out.update(dataclasses.asdict(value))
        else:
            out[f"{part.name}_config"] = value
    out.pop("model")
    return out


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import serve as bench_serve

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    ps = bsub.add_parser("serve", help="open-loop load generator (vllm bench serve semantics)")
    bench_serve.add_cli_args(ps)
    ps.set_defaults(func=bench_serve.main)
    from pdserve.bench import sla as bench_sla

    pl = bsub.add_parser("sla", help="largest load that meets a TTFT/TPOT SLA (bench serve runs)")
    bench_sla.add_cli_args(pl)
    pl.set_defaults(func=bench_sla.main)


def _add_soak(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import soak

    p = sub.add_parser("soak", help="fixed-rate load while sampling RSS; fails on a memory leak")
    soak.add_cli_args(p)
    p.set_defaults(func=soak.main)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from pdserve.bench import plan

    p = sub.add_parser(
        "plan", help="predict the best colocated / xPyD split of N GPUs from measured curves"
    )
    plan.add_cli_args(p)
    p.set_defaults(func=plan.main)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from pdserve.serving.api import cli as serve_cli

    p = sub.add_parser("serve", help="OpenAI-compatible server (API process + engine-core process)")
    serve_cli.add_cli_args(p)


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    from pdserve.serving.proxy import cli as proxy_cli

    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible P/D router over prefill and decode pools, or load balancer "
        "over colocated instances",
    )
    proxy_cli.add_cli_args(p)
    p.set_defaults(func=proxy_cli.main)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    from pdserve.serving.launch import cli as launch_cli

    p = sub.add_parser("launch", help="start an xPyD topology (instances + proxy) from YAML")
    launch_cli.add_cli_args(p)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_make_checkpoint,
    _add_generate,
    _add_serve,
    _add_proxy,
    _add_launch,
    _add_bench,
    _add_soak,
    _add_plan,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pdserve.serving.module_cli import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
