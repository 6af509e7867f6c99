"""``pdserve launch TOPOLOGY.yaml``: flags and entry point of the topology launcher.

:func:`main` loads the topology (exit 2 on a bad file), prints the plan with
``--dry-run``, or runs a :class:`~pdserve.serving.launch.launcher.Launcher` with
SIGINT/SIGTERM/SIGHUP wired to ``request_stop`` (exit 0 after a requested stop, 1 on a
failure). ``python -m pdserve.serving.launch`` runs the same command without the rest of
the ``pdserve`` CLI.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from pdserve.core_types.pd_auth import SECRET_ENV
from pdserve.serving.launch.launcher import LaunchAborted, Launcher, LaunchError
from pdserve.serving.launch.topology import NODE_IP, NODE_PYTHON, Topology, TopologyError

logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topology", help="topology YAML file (see examples/*.yaml)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every process's exact command and environment, start nothing",
    )
    parser.add_argument("--log-dir", default=None, help="overrides the topology's log_dir")
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help='place the instances on the running Ray cluster at ADDRESS ("auto" or the '
        "head's host:port), whatever the file's `placement` says; see docs/LAUNCH.md",
    )
    parser.set_defaults(func=main)


def dry_run_text(topology: Topology, log_dir: str | None = None) -> str:
    """What ``--dry-run`` prints: per process a comment line and one shell line."""
    where = log_dir or topology.log_dir
    base = Path(where).expanduser() if where else Path("<new temp dir>")
    specs = topology.plan(base)
    policy = topology.restart
    on_failure = topology.on_failure
    if on_failure == "restart":
        on_failure += (
            f" (at most {policy.max_restarts} restarts of a process within "
            f"{policy.window:g}s, back-off {policy.backoff:g}s doubling to "
            f"{policy.max_backoff:g}s)"
        )
    out = [
        f"# pdserve launch --dry-run {topology.source}: {len(specs)} process(es), logs in {base}",
        "# instances start together; the proxy starts once every instance answers "
        "GET /health with 200",
        f"# on_failure: {on_failure}",
        f"# every process also gets {SECRET_ENV} in its environment (the launcher's own, "
        "else a new one per launch); it is not shown",
    ]
    placement = topology.placement
    if placement.ray:
        out += [
            f"# placement: ray, cluster at {placement.address}: one placement group "
            "(STRICT_PACK, one bundle) and one actor per instance process; the proxy runs here",
            f"# on each node: {NODE_PYTHON} is the Ray worker's Python there, {NODE_IP} the "
            "node's IP (the instance binds it), {ray_gpu_ids} the GPUs Ray assigns",
        ]
    out += [f"# warning: {w}" for w in topology.warnings]
    for s in specs:
        bundle = f" bundle={s.bundle.as_ray()}" if s.bundle is not None else ""
        out += [
            "",
            f"# {s.name}: role={s.role} url={s.url} devices={s.devices} "
            f"startup_timeout={s.startup_timeout:g}s log={s.log_file}{bundle}",
            s.shell_line(),
        ]
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve launch``: 0 after a requested stop, 1 on failure, 2 on a bad file."""
    try:
        topology = Topology.load(args.topology, ray_address=args.ray_address)
    except TopologyError as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dry_run_text(topology, args.log_dir), flush=True)
        return 0
    launcher = Launcher(topology, log_dir=args.log_dir)
    previous = _install_signal_handlers(launcher)
    try:
        launcher.start()
        return launcher.wait()
    except LaunchAborted:
        logger.info("stopped during start-up")
        return 0
    except LaunchError as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _install_signal_handlers(launcher: Launcher) -> dict[int, Any]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("got %s", signal.Signals(signum).name)
        launcher.request_stop()

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    return {s: signal.signal(s, on_signal) for s in sigs}
