"""Instances placed on a Ray cluster (``placement: {backend: ray}``): one placement group
and one actor per instance process; the actor runs ``pdserve serve`` on its node.

Lifecycle, driven by :class:`~pdserve.serving.launch.launcher.Launcher`:

1. ``RayPlacement(spec)`` imports ``ray`` (a :class:`LaunchError` naming the package
   when it is missing); ``connect()`` joins the running cluster at ``placement.address``
   (``ray.init(address=...)``: never a new cluster) in the ``pdserve`` namespace.
2. ``place(specs)`` creates one placement group per instance process (one bundle, the
   process's :class:`~pdserve.serving.launch.placement.Bundle`, ``STRICT_PACK``), waits
   up to ``placement_timeout`` for all of them, then starts one :class:`InstanceHost`
   actor in each (named ``pdserve-<launch id>-<process name>``, asking the whole
   bundle, so Ray assigns its GPUs) and asks each where it landed: its node's IP and
   the GPU ids Ray gave it. The launcher re-plans with that (bind address, KV server
   address, ``CUDA_VISIBLE_DEVICES``) and asks each actor whether the port is free.
3. ``child(spec, ...)`` starts the process through its actor: the actor keeps a local
   :class:`~pdserve.serving.launch.children.Child` on the node (own session,
   ``PR_SET_PDEATHSIG`` to the actor's worker, log at the same path on that node), and
   the returned :class:`RayChild` forwards the launcher's polls and signals to it.
   Restarts reuse the actor, so a restarted instance keeps its node, GPUs and port.
4. ``close()`` (after the launcher has stopped the processes): each actor SIGKILLs
   whatever its process groups left, then every actor is killed, every placement group
   removed, and the driver disconnects. If the launcher itself dies, Ray ends its job:
   the actors die (their processes get SIGTERM through PDEATHSIG) and the placement
   groups are removed.

The P/D secret reaches each node as an argument of the actor call that starts the
process (inside the cluster's own channel), and from there only its environment.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from pdserve.serving.launch.children import (
    Child,
    LaunchAborted,
    LaunchError,
    check_port_free,
    group_alive,
)
from pdserve.serving.launch.placement import NodeAssignment, PlacementSpec
from pdserve.serving.launch.topology import NODE_PYTHON, ProcessSpec

__all__ = ["RayPlacement", "RayChild", "InstanceHost", "import_ray", "NAMESPACE"]

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
MISSING_RAY = (
    "placement.backend: ray needs the `ray` package, on the launcher's machine and on "
    "every node of the cluster: pip install 'pdserve[ray]' (or pip install ray)"
)
_CALL_TIMEOUT_S = 30.0  # one actor call that starts or stops something
_POLL_TIMEOUT_S = 10.0  # one poll of a running process
_STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM] + (
    [signal.SIGHUP] if hasattr(signal, "SIGHUP") else []
)


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`LaunchError` saying which package to install."""
    try:
        import ray
    except ImportError as e:
        raise LaunchError(f"{MISSING_RAY} ({e})") from None
    return ray


class InstanceHost:
    """The Ray actor that runs one instance process on its node (``ray.remote`` is
    applied at placement time, so importing this module needs no ``ray``)."""

    def __init__(self) -> None:
        self._runs: list[Child] = []  # every run of the process, the current one last

    def where(self) -> tuple[str, tuple[str, ...], str]:
        """(node IP, GPU ids Ray assigned to this actor, node id)."""
        import ray

        ctx = ray.get_runtime_context()
        gpus = tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))
        return str(ray.util.get_node_ip_address()), gpus, str(ctx.get_node_id())

    def check_port(self, spec: ProcessSpec) -> str | None:
        try:
            check_port_free(spec)
        except LaunchError as e:
            return str(e)
        return None

    def start(self, spec: ProcessSpec, extra_env: dict[str, str], restart: int) -> int:
        if spec.cmd and spec.cmd[0] == NODE_PYTHON:  # this node's Python (the worker's)
            spec = replace(spec, cmd=(sys.executable, *spec.cmd[1:]))
        child = Child(spec, extra_env, restart=restart)
        self._runs.append(child)
        return child.pid

    def _current(self) -> Child:
        if not self._runs:
            raise RuntimeError("no process was started by this actor")
        return self._runs[-1]

    def exit_code(self) -> int | None:
        return self._current().exit_code()

    def tail(self, n: int) -> str:
        return self._current().tail(n)

    def terminate(self) -> None:
        self._current().terminate()

    def kill_group(self, sig: int) -> None:
        self._current().kill_group(sig)

    def group_alive(self) -> bool:
        return self._current().group_alive()

    def wait(self, timeout: float) -> int | None:
        return self._current().wait(timeout)

    def close(self) -> None:
        """SIGKILL what any run left in its process group; close the logs."""
        for child in self._runs:
            if child.exit_code() is None or group_alive(child.pid):
                child.kill_group(signal.SIGKILL)
                child.wait(5)
            child.close()


class _ActorGone(Exception):
    pass


class RayChild:
    """An instance process on a Ray node, seen from the launcher: the same surface as a
    local :class:`~pdserve.serving.launch.children.Child`, each call a call to its actor.
    A dead actor (its node lost, or killed) reads as an exited process."""

    def __init__(
        self,
        ray: Any,
        actor: Any,
        spec: ProcessSpec,
        node: NodeAssignment,
        extra_env: Mapping[str, str],
        restart: int = 0,
    ) -> None:
        self._ray = ray
        self._actor = actor
        self.spec = spec
        self.node = node
        self.restart = restart
        self._gone: str | None = None  # why the actor is gone
        try:
            self.pid = int(self._call("start", spec, dict(extra_env), restart))
        except _ActorGone:
            raise LaunchError(f"{spec.name}: cannot start it: {self._gone}") from None
        self.started_at = time.monotonic()
        self.ready_after: float | None = None
        self.death_reported = False

    def _call(self, method: str, *args: Any, timeout: float = _CALL_TIMEOUT_S) -> Any:
        if self._gone is not None:
            raise _ActorGone(self._gone)
        exc = self._ray.exceptions
        try:
            return self._ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)
        except exc.GetTimeoutError:
            raise LaunchError(
                f"{self.spec.name}: its Ray actor on {self.node.ip} did not answer "
                f"{method} within {timeout:g}s"
            ) from None
        except exc.RayActorError as e:
            self._gone = f"its Ray actor on node {self.node.ip} died ({_first_line(e)})"
            raise _ActorGone(self._gone) from None
        except exc.RayTaskError as e:
            raise LaunchError(
                f"{self.spec.name}: {method} failed on node {self.node.ip}: {e}"
            ) from None

    @property
    def ready(self) -> bool:
        return self.ready_after is not None

    def exit_code(self) -> int | None:
        try:
            code = self._call("exit_code", timeout=_POLL_TIMEOUT_S)
        except _ActorGone:
            return -signal.SIGKILL
        except LaunchError as e:  # a slow answer is not a death; the next poll asks again
            logger.warning("%s", e)
            return None
        return None if code is None else int(code)

    def tail(self, n: int = 20) -> str:
        try:
            return str(self._call("tail", n))
        except (_ActorGone, LaunchError) as e:
            return f"    (log on node {self.node.ip} unreadable: {e})"

    def describe_exit(self, code: int) -> str:
        where = f"{self.spec.name} (pid {self.pid} on node {self.node.ip})"
        if self._gone is not None:
            return f"{where} is gone: {self._gone}"
        how = f"signal {-code}" if code < 0 else f"code {code}"
        return (
            f"{where} exited with {how}; last lines of {self.spec.log_file} on that node:\n"
            f"{self.tail()}"
        )

    def terminate(self) -> None:
        self._quietly("terminate")

    def kill_group(self, sig: int) -> None:
        self._quietly("kill_group", sig)

    def group_alive(self) -> bool:
        try:
            return bool(self._call("group_alive", timeout=_POLL_TIMEOUT_S))
        except _ActorGone:
            return False
        except LaunchError as e:
            logger.warning("%s", e)
            return True

    def wait(self, timeout: float) -> int | None:
        try:
            code = self._call("wait", timeout, timeout=timeout + _CALL_TIMEOUT_S)
        except _ActorGone:
            return -signal.SIGKILL
        except LaunchError as e:
            logger.warning("%s", e)
            return None
        return None if code is None else int(code)

    def close(self) -> None:
        """Nothing to close here: the log handle lives on the node (closed by
        :meth:`RayPlacement.close`)."""

    def _quietly(self, method: str, *args: Any) -> None:
        try:
            self._call(method, *args)
        except _ActorGone:
            pass
        except LaunchError as e:
            logger.warning("%s", e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class RayPlacement:
    """The launcher's side of a Ray placement: see the module docstring."""

    def __init__(self, spec: PlacementSpec) -> None:
        if not spec.ray:
            raise ValueError("RayPlacement needs placement.backend: ray")
        self.spec = spec
        self._ray = import_ray()
        self.launch_id = uuid.uuid4().hex[:8]
        self._pgs: dict[str, Any] = {}
        self._actors: dict[str, Any] = {}
        self.nodes: dict[str, NodeAssignment] = {}
        self._connected = False

    def connect(self) -> None:
        ray = self._ray
        address = self.spec.address
        if ray.is_initialized():
            raise LaunchError("this process is already connected to a Ray cluster")
        _check_listening(address)  # ray.init waits minutes for an address nobody serves
        logger.info("connecting to the Ray cluster at %s", address)
        # ray.init takes SIGTERM (a sys.exit, and a crash report on stderr): give it back
        # to whoever had it (pdserve launch: a clean stop, as without Ray)
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in _STOP_SIGNALS} if main else {}
        try:
            ray.init(
                address=address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise LaunchError(
                f"cannot connect to the Ray cluster at placement.address {address!r}: "
                f"{_first_line(e).rstrip('.')}. {_START_ONE}"
            ) from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self._connected = True

    def actor_name(self, process: str) -> str:
        return f"pdserve-{self.launch_id}-{process}"

    def _wait_all(self, refs: list[Any], deadline: float, stop: Callable[[], bool]) -> set[Any]:
        """The refs ready by ``deadline`` (``time.monotonic()``); a requested stop ends
        the wait with :class:`LaunchAborted`."""
        ready: set[Any] = set()
        while len(ready) < len(refs):
            if stop():
                raise LaunchAborted("stop requested during placement; everything was stopped")
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pending = [r for r in refs if r not in ready]
            done, _ = self._ray.wait(pending, num_returns=len(pending), timeout=min(left, 0.5))
            ready.update(done)
        return ready

    def place(
        self, specs: list[ProcessSpec], stop: Callable[[], bool] = lambda: False
    ) -> dict[str, NodeAssignment]:
        """One placement group and one actor per instance process; where each landed.
        ``stop`` is polled while waiting (a Ctrl-C aborts the placement)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        timeout = self.spec.placement_timeout
        deadline = time.monotonic() + timeout
        for s in specs:
            assert s.bundle is not None, s.name
            self._pgs[s.name] = placement_group(
                [s.bundle.as_ray()], strategy="STRICT_PACK", name=self.actor_name(s.name)
            )
        refs = {self._pgs[s.name].ready(): s for s in specs}
        ready = self._wait_all(list(refs), deadline, stop)
        waiting = [refs[r] for r in refs if r not in ready]
        if waiting:
            asked = "; ".join(f"{s.name} asks {s.bundle.as_ray()}" for s in waiting if s.bundle)
            raise LaunchError(
                f"placement failed: no node could take the placement group of "
                f"{', '.join(s.name for s in waiting)} within {timeout:g}s "
                f"(placement.placement_timeout): {asked}; the cluster has "
                f"{_resources(ray.available_resources())} free of "
                f"{_resources(ray.cluster_resources())}"
            )
        host_cls = ray.remote(InstanceHost)
        for s in specs:
            assert s.bundle is not None
            b = s.bundle
            self._actors[s.name] = host_cls.options(
                name=self.actor_name(s.name),
                num_cpus=b.num_cpus,
                num_gpus=b.num_gpus,
                resources=dict(b.resources),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pgs[s.name], placement_group_bundle_index=0
                ),
            ).remote()
        wheres = {s.name: self._actors[s.name].where.remote() for s in specs}
        ready = self._wait_all(list(wheres.values()), deadline, stop)
        for name, ref in wheres.items():
            if ref not in ready:
                raise LaunchError(
                    f"placement failed: the Ray actor of {name} did not start within "
                    f"{timeout:g}s (placement.placement_timeout)"
                )
            try:
                ip, gpus, node_id = ray.get(ref, timeout=_CALL_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                raise LaunchError(
                    f"placement failed: the Ray actor of {name} did not start: {_first_line(e)}"
                ) from None
            self.nodes[name] = NodeAssignment(ip=ip, gpus=tuple(gpus), node_id=node_id)
            logger.info("%s placed on node %s (%s), GPUs %s", name, ip, node_id[:12], gpus or "-")
        return dict(self.nodes)

    def check_port(self, spec: ProcessSpec) -> None:
        ray = self._ray
        try:
            problem = ray.get(
                self._actors[spec.name].check_port.remote(spec), timeout=_CALL_TIMEOUT_S
            )
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            raise LaunchError(
                f"{spec.name}: checking its port on node {self.nodes[spec.name].ip} failed: "
                f"{_first_line(e)}"
            ) from None
        if problem:
            raise LaunchError(f"{problem} (on node {self.nodes[spec.name].ip})")

    def child(self, spec: ProcessSpec, extra_env: Mapping[str, str], restart: int = 0) -> RayChild:
        return RayChild(
            self._ray, self._actors[spec.name], spec, self.nodes[spec.name], extra_env, restart
        )

    def close(self) -> None:
        """Kill every actor (after it SIGKILLed its leftovers), remove every placement
        group, disconnect. Idempotent; errors are logged, not raised."""
        if not self._connected:
            return
        ray = self._ray
        closing = {name: a.close.remote() for name, a in self._actors.items()}
        for name, ref in closing.items():
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=_CALL_TIMEOUT_S)
            try:
                ray.kill(self._actors[name], no_restart=True)
            except Exception as e:
                logger.warning("could not kill the Ray actor of %s: %s", name, e)
        from ray.util.placement_group import remove_placement_group

        for name, pg in self._pgs.items():
            try:
                remove_placement_group(pg)
            except Exception as e:
                logger.warning("could not remove the placement group of %s: %s", name, e)
        self._actors.clear()
        self._pgs.clear()
        ray.shutdown()
        self._connected = False
        logger.info("Ray actors and placement groups of launch %s removed", self.launch_id)


_START_ONE = (
    "pdserve launch never starts a cluster: start one first (`ray start --head` on this "
    "machine, `ray start --address HEAD_IP:PORT` on the others)"
)


def _check_listening(address: str) -> None:
    """A ``host:port`` address must at least accept a TCP connection."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise LaunchError(
            f"cannot connect to the Ray cluster at placement.address {address!r}: nothing "
            f"answers there ({e.strerror or e}); it is the head's GCS address, which "
            f"`ray start --head` prints. {_START_ONE}"
        ) from None


def _resources(res: Mapping[str, float]) -> str:
    shown = {k: v for k, v in sorted(res.items()) if not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"
