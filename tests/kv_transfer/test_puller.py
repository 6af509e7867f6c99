"""The decode side's puller: one worker per prefill endpoint (a dead or silent peer
delays only itself), per-job deadlines, the allowlist, authenticated replies only,
notices split to the server's bound, supervision of dead workers (loopback only)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from _kv_side_channel import COMPAT, caches, free_port, kv_server, silent_listener
from _polling import wait_until
from pdserve.core_types.kv_connector import KVLoad, KVNotice, KVPeer
from pdserve.core_types.pd_auth import SECRET_ENV, new_secret
from pdserve.kv_transfer.handler import ServerLimits
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.puller import _LOAD, KVPuller, LoadResult
from pdserve.kv_transfer.server import KVServer
from pdserve.kv_transfer.transports.tcp import TcpClient

SECRET = new_secret().encode()
HELD = [5, 1, 2]


@pytest.fixture
def prefill() -> Iterator[tuple[KVServer, LeaseTable]]:
    leases = LeaseTable(30.0)
    for rid in ("r0", "r1", "r2"):
        leases.add(rid, HELD)
    srv = kv_server(SECRET, leases, ServerLimits(max_ids_per_message=4))
    yield srv, leases
    srv.close()


def _puller(secret: bytes = SECRET, hs: float = 5.0, tt: float = 5.0, **kw: object) -> KVPuller:
    dst = caches(seed=None)
    return KVPuller(COMPAT, lambda info: TcpClient(dst, info), hs, tt, secret, **kw)  # type: ignore[arg-type]


def _load(rid: str, port: int, remote: str = "r0") -> KVLoad:
    return KVLoad(rid, KVPeer("127.0.0.1", port), remote, [0, 1, 2], 0, len(HELD))


class _Results:
    def __init__(self, puller: KVPuller) -> None:
        self.puller = puller
        self.got: dict[str, LoadResult] = {}
        self.at: dict[str, float] = {}

    def wait(self, rids: set[str], timeout: float) -> dict[str, LoadResult]:
        def done() -> bool:
            for r in self.puller.take_results():
                self.got[r.request_id] = r
                self.at[r.request_id] = time.monotonic()
            return rids <= set(self.got)

        assert wait_until(done, timeout, 0.005), f"no result for {rids - set(self.got)}"
        return self.got


def test_a_read_moves_the_blocks_and_releases_the_lease(prefill) -> None:
    srv, leases = prefill
    p = _puller()
    try:
        p.load(_load("a", srv.port))
        r = _Results(p).wait({"a"}, 5.0)["a"]
        assert r.error is None and r.nbytes == 3 * caches().bytes_per_block()
        assert wait_until(lambda: leases.take_done() == ["r0"], 2.0)
    finally:
        p.close()


def test_dead_and_silent_peers_do_not_delay_another_peer(prefill) -> None:
    srv, _ = prefill
    p = _puller(hs=5.0)
    res = _Results(p)
    try:
        with silent_listener() as silent:
            t0 = time.monotonic()
            p.load(_load("dead", free_port()))
            p.load(_load("silent", silent))
            p.heartbeat(KVNotice(KVPeer("127.0.0.1", silent), ["x"]))
            p.load(_load("legit", srv.port))
            got = res.wait({"legit"}, 3.0)
            assert got["legit"].error is None
            assert res.at["legit"] - t0 < 1.0  # the bad peers' 5 s handshakes run apart
            assert "dead" not in got and "silent" not in got
            assert p.num_peers == 3
            t1 = time.monotonic()
        p.close()  # does not wait out the bad peers' handshakes
        assert time.monotonic() - t1 < 2.0
    finally:
        p.close()


def test_a_peer_found_down_fails_its_queued_jobs_at_once() -> None:
    p = _puller(hs=0.3, tt=5.0)
    res = _Results(p)
    try:
        with silent_listener() as silent:
            t0 = time.monotonic()
            for i in range(5):
                p.load(_load(f"j{i}", silent))
            got = res.wait({f"j{i}" for i in range(5)}, 3.0)
            assert max(res.at.values()) - t0 < 0.6  # one 0.3 s handshake, not five in a row
            errors = [got[f"j{i}"].error or "" for i in range(5)]
            assert "no answer" in errors[0]
            assert all(
                "handshake failed: no answer" in e and "not retried" in e for e in errors[1:]
            )
            time.sleep(0.35)  # after the pause the peer is dialled again
            t1 = time.monotonic()
            p.load(_load("again", silent))
            err = res.wait({"again"}, 3.0)["again"].error or ""
            assert "not retried" not in err and res.at["again"] - t1 >= 0.25
    finally:
        p.close()


def test_a_job_past_its_deadline_fails_without_touching_the_wire() -> None:
    p = _puller(hs=0.5, tt=5.0)
    res = _Results(p)
    try:
        with silent_listener() as silent:
            p.load(_load("slow", silent))  # keeps the worker busy for 0.5 s
            load = _load("late", silent)
            assert p._submit(KVPeer("127.0.0.1", silent), _LOAD, 0.1, load) is None
            got = res.wait({"slow", "late"}, 3.0)
            assert "deadline" in (got["late"].error or "")
    finally:
        p.close()


def test_endpoints_outside_the_allowlist_are_never_dialled(prefill) -> None:
    srv, _ = prefill
    p = _puller(allowed=frozenset({("127.0.0.1", srv.port)}))
    try:
        with silent_listener() as other:
            listener_port = other
            p.load(_load("evil", listener_port))
            p.heartbeat(KVNotice(KVPeer("127.0.0.1", listener_port), ["x"]))
            p.notify_done(KVNotice(KVPeer("127.0.0.1", listener_port), ["x"]))
            got = _Results(p).wait({"evil"}, 0.5)["evil"]
            assert got.error is not None and "allowed_prefill" in got.error
            assert p.num_peers == 0
        p.load(_load("ok", srv.port))
        assert _Results(p).wait({"ok"}, 5.0)["ok"].error is None
    finally:
        p.close()


def test_dialled_endpoints_are_bounded() -> None:
    p = _puller(hs=2.0, max_peers=2)
    try:
        with silent_listener() as a, silent_listener() as b, silent_listener() as c:
            for i, port in enumerate((a, b, c)):
                p.load(_load(f"p{i}", port))
            got = _Results(p).wait({"p2"}, 0.5)["p2"]
            assert got.error is not None and "max_prefill_peers=2" in got.error
            assert p.num_peers == 2
    finally:
        p.close()


def test_a_prefill_without_the_secret_is_not_trusted(prefill) -> None:
    srv, leases = prefill
    p = _puller(secret=new_secret().encode())  # a decode of another topology
    try:
        p.load(_load("a", srv.port))
        err = _Results(p).wait({"a"}, 5.0)["a"].error or ""
        assert "not authenticated" in err and SECRET_ENV in err
        assert leases._leases["r0"].reads == 0  # nothing was read
    finally:
        p.close()
    # and a "prefill" that answers without the secret: decode refuses its reply
    fake = kv_server(new_secret().encode(), LeaseTable(30.0))
    p = _puller()
    try:
        p.load(_load("b", fake.port))
        err = _Results(p).wait({"b"}, 5.0)["b"].error or ""
        assert "reply is not authenticated" in err
    finally:
        p.close()
        fake.close()


def test_notices_are_split_to_the_servers_bound(prefill) -> None:
    srv, leases = prefill
    p = _puller(max_ids_per_message=4)
    try:
        before = {r: leases._leases[r].expiry for r in ("r0", "r1", "r2")}
        leases.extension = 60.0  # so a renewal shows
        ids = ["r0", "r1", *[f"gone{i}" for i in range(8)], "r2"]
        p.heartbeat(KVNotice(KVPeer("127.0.0.1", srv.port), ids))
        assert wait_until(lambda: all(leases._leases[r].expiry > before[r] for r in before), 3.0), (
            "not every lease was renewed"
        )
        p.notify_done(KVNotice(KVPeer("127.0.0.1", srv.port), ids))
        assert wait_until(lambda: len(leases) == 0, 3.0)
        assert srv.handler.rejected["limit"] == 0
    finally:
        p.close()


class _Die(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_is_restarted_and_its_read_fails(prefill, monkeypatch) -> None:
    srv, _ = prefill
    p = _puller()
    try:
        real = KVPuller._run_job

        def die(self: KVPuller, w: object, job: object) -> None:
            monkeypatch.setattr(KVPuller, "_run_job", real)  # only the first job dies
            raise _Die("injected by the test")

        monkeypatch.setattr(KVPuller, "_run_job", die)
        p.load(_load("a", srv.port))
        assert wait_until(lambda: bool(p.supervise()) or bool(p.num_restarts), 3.0)
        res = _Results(p)
        err = res.wait({"a"}, 1.0)["a"].error or ""
        assert "died" in err and "injected" in err
        p.load(_load("b", srv.port, remote="r1"))  # the restarted worker serves the peer
        assert res.wait({"b"}, 5.0)["b"].error is None
        assert p.num_restarts == 1
    finally:
        p.close()


def test_close_with_idle_and_busy_workers_is_prompt(prefill) -> None:
    srv, _ = prefill
    p = _puller()
    p.load(_load("a", srv.port))
    _Results(p).wait({"a"}, 5.0)
    with socket.socket() as s:  # one more peer mid-handshake
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        p.load(_load("b", s.getsockname()[1]))
        time.sleep(0.1)
        t0 = time.monotonic()
        p.close()
        assert time.monotonic() - t0 < 1.0
    p.load(_load("c", srv.port))  # after close: refused at once
    assert "shut down" in (_Results(p).wait({"c"}, 0.5)["c"].error or "")
