"""The KV side channel under hostile input: a real KV server (ROUTER thread) over small
CPU caches, raw peers that send anything, and the decode-side puller (loopback only)."""

from __future__ import annotations

import random
import socket
import time

import pytest

from _kv_side_channel import COMPAT, RawPeer, error_of, kv_server
from pdserve.core_types.pd_auth import SECRET_ENV, mac, new_secret
from pdserve.kv_transfer import wire as W
from pdserve.kv_transfer.handler import ServerLimits
from pdserve.kv_transfer.lease import LeaseTable
from pdserve.kv_transfer.supervisor import FIRST_DELAY_S, Supervisor

SECRET = new_secret().encode()
OTHER = new_secret().encode()
HELD = [5, 1, 2]


def _leases(max_reads: int = 3) -> LeaseTable:
    t = LeaseTable(30.0, max_reads)
    t.add("r", HELD)
    return t


def _read(rid: str = "r") -> W.Read:
    return W.Read(rid, 0, len(HELD), len(HELD))


def test_envelope_verifies_before_decoding() -> None:
    session = b"s" * W.SESSION_BYTES
    tag, head, payload = W.seal_request(SECRET, W.Heartbeat(["a"]), session, 7)
    assert W.open_request(SECRET, [tag, head, payload]) == (tag, session, 7, W.Heartbeat(["a"]))
    for frames in (
        [tag, head, payload + b"x"],
        [tag[:-1] + bytes([tag[-1] ^ 1]), head, payload],  # a random secret: flip, never set
        [b"", head, payload],
        [tag, W.header(session, 8), payload],  # the counter is covered
        [tag, W.header(b"t" * W.SESSION_BYTES, 7), payload],  # and the session
    ):
        with pytest.raises(W.NotAuthenticated):
            W.open_request(SECRET, frames)
    with pytest.raises(W.NotAuthenticated):
        W.open_request(OTHER, [tag, head, payload])
    for frames in ([payload], [tag, payload], [tag, head, payload, b""], []):
        with pytest.raises(W.Malformed, match="expected 3 frames"):
            W.open_request(SECRET, frames)
    junk = b"\xc1not msgpack"
    with pytest.raises(W.Malformed, match="undecodable"):
        W.open_request(SECRET, [mac(SECRET, W.REQUEST_LABEL, head, junk), head, junk])
    # a handshake opens a session, nothing else may come without one
    with pytest.raises(W.Malformed, match="needs one"):
        W.open_request(SECRET, list(W.seal_request(SECRET, W.Heartbeat(["a"]))))
    with pytest.raises(W.Malformed, match="opens a session"):
        W.open_request(SECRET, list(W.seal_request(SECRET, W.Handshake({}), session, 1)))
    # a reply is bound to its request: the same reply to another request does not verify
    rtag, rpayload = W.seal_reply(SECRET, tag, W.Ack())
    assert W.open_reply(SECRET, tag, [rtag, rpayload, b"bulk"]) == (W.Ack(), [b"bulk"])
    other_tag, _, _ = W.seal_request(SECRET, W.Heartbeat(["a"]), session, 8)
    with pytest.raises(W.NotAuthenticated):
        W.open_reply(SECRET, other_tag, [rtag, rpayload])
    with pytest.raises(W.NotAuthenticated, match=f"unverified.*not authenticated.*{SECRET_ENV}"):
        W.open_reply(SECRET, tag, list(W.unsigned_error(W.NOT_AUTHENTICATED)))


def test_sessions_accept_each_counter_once() -> None:
    sessions = W.Sessions(max_sessions=2)
    a = sessions.open()
    sessions.accept(a, 1)
    sessions.accept(a, 5)  # gaps are fine (a request that timed out on the way)
    for counter in (5, 3, 0):
        with pytest.raises(W.Replayed, match="replayed"):
            sessions.accept(a, counter)
    with pytest.raises(W.Replayed, match="unknown"):
        sessions.accept(b"x" * W.SESSION_BYTES, 1)
    b, c = sessions.open(), sessions.open()  # a is the least recently used: forgotten
    assert len(sessions) == 2 and len({a, b, c}) == 3
    with pytest.raises(W.Replayed, match="unknown"):
        sessions.accept(a, 6)
    sessions.accept(b, 1)
    sessions.accept(c, 1)


def test_recorded_frames_are_refused() -> None:
    """A recorded heartbeat, read or done notice sent again (on its connection or on
    another) is refused before it renews, reads or frees anything."""
    leases = _leases(max_reads=3)
    srv = kv_server(SECRET, leases)
    peer, spy = RawPeer(srv.port), RawPeer(srv.port)
    try:
        reply, _ = peer.call(SECRET, W.Heartbeat(["r"]))
        assert isinstance(reply, W.Ack)
        heartbeat = peer.sent[-1]
        reply, frames = peer.call(SECRET, _read())
        assert isinstance(reply, W.ReadReply) and len(frames) == 1
        read = peer.sent[-1]
        expiry = leases._leases["r"].expiry
        for recorded in (heartbeat, read):
            for via in (peer, spy):  # the same connection, and another one
                reply, frames = via.replay(SECRET, recorded)
                assert isinstance(reply, W.Error) and "replayed" in reply.message
                assert frames == []
        lease = leases._leases["r"]
        assert lease.reads == 1 and lease.expiry == expiry and not lease.finished
        reply, _ = peer.call(SECRET, W.Done(["r"]))
        assert isinstance(reply, W.Ack) and leases.take_done() == ["r"]
        leases.add("r", HELD)  # held again: a recorded done notice must not free it
        reply, _ = spy.replay(SECRET, peer.sent[-1])
        assert isinstance(reply, W.Error) and "replayed" in reply.message
        assert leases.take_done() == [] and "r" in leases._leases
        assert srv.handler.rejected["replayed"] == 5
    finally:
        peer.close()
        spy.close()
        srv.close()


def test_reads_are_bound_to_the_prompt_and_the_first_consumer() -> None:
    leases = LeaseTable(30.0, max_reads=3)
    leases.add("r", HELD, "digest-of-r")
    srv = kv_server(SECRET, leases)
    peer = RawPeer(srv.port)
    try:
        n = len(HELD)
        reply, frames = peer.call(SECRET, W.Read("r", 0, n, n, "digest-of-x", "decode-a"))
        assert isinstance(reply, W.Error) and "another prompt" in reply.message and not frames
        reply, frames = peer.call(SECRET, W.Read("r", 0, n, n, "digest-of-r", "decode-a"))
        assert isinstance(reply, W.ReadReply) and len(frames) == 1
        reply, frames = peer.call(SECRET, W.Read("r", 0, n, n, "digest-of-r", "decode-b"))
        assert isinstance(reply, W.Error) and "another decode instance" in reply.message
        assert leases._leases["r"].reads == 1 and srv.handler.rejected["limit"] == 2
    finally:
        peer.close()
        srv.close()


def test_server_survives_any_byte_sequence() -> None:
    leases = _leases()
    srv = kv_server(SECRET, leases)
    peer = RawPeer(srv.port)
    try:
        # the message that killed the thread on main: two frames (ROUTER sees three)
        assert "expected 3 frames" in error_of(peer.ask([b"hello", b"world"]))
        assert "expected 3 frames" in error_of(peer.ask([b""]))  # an empty message
        assert error_of(peer.ask([b"a", b"b", b"c"])) == W.NOT_AUTHENTICATED
        assert "expected 3 frames" in error_of(peer.ask([b"a", b"b", b"c", b"d"]))
        assert "expected 3 frames" in error_of(peer.ask([b"z" * 1000] * 500))
        rng = random.Random(0)
        for _ in range(200):
            frames = [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(1, 5))]
            assert error_of(peer.ask(frames))  # each gets an (unsigned) error reply
        with socket.create_connection(("127.0.0.1", srv.port)) as raw:  # not even ZMTP
            raw.sendall(rng.randbytes(4096))
        big = RawPeer(srv.port)  # bigger than any control message: disconnected, no reply
        assert big.ask([b"x" * 32, b"y" * (3 << 20)], timeout=0.5) is None
        big.close()
        assert srv.alive
        reply, _ = peer.call(SECRET, W.Handshake(COMPAT))
        assert isinstance(reply, W.HandshakeReply) and reply.engine_id == "prefill-0"
        reply, frames = peer.call(SECRET, _read())
        assert isinstance(reply, W.ReadReply) and reply.block_ids == HELD and len(frames) == 1
        rejected = srv.handler.rejected
        assert rejected["malformed"] >= 2 and rejected["unauthenticated"] >= 2
        # (raw bytes without the ZMTP 3 signature parse as ZMTP 1.0 frames: refused too)
        assert rejected["malformed"] + rejected["unauthenticated"] >= 203
    finally:
        peer.close()
        srv.close()


def test_unauthenticated_messages_are_refused_and_change_nothing() -> None:
    leases = _leases()
    srv = kv_server(SECRET, leases)
    peer = RawPeer(srv.port)
    try:
        expiry = leases._leases["r"].expiry
        msgs: list[W.ToServer] = [W.Handshake(COMPAT), _read(), W.Done(["r"]), W.Heartbeat(["r"])]
        for msg in msgs:
            payload = W.encode(msg)
            head = W.header(W.NO_SESSION, 0)
            forged = [
                [payload],  # no MAC at all
                [b"\0" * 32, head, payload],  # a made-up MAC
                list(W.seal_request(OTHER, msg)),  # another topology's secret
                [mac(SECRET, W.REPLY_LABEL, head, payload), head, payload],  # another purpose
            ]
            for frames in forged:
                parts = peer.ask(frames)
                assert parts is not None and b"compat" not in b"".join(parts)
                assert b"model_config_hash" not in b"".join(parts)
                msg_text = error_of(parts)
                assert msg_text in (
                    W.NOT_AUTHENTICATED,
                    "expected 3 frames (mac, header, message), got 1",
                )
        lease = leases._leases["r"]  # still held, never read, not renewed, not released
        assert lease.expiry == expiry and lease.reads == 0 and not lease.finished
        assert leases.take_done() == []
        assert srv.handler.rejected["unauthenticated"] == 12
        assert srv.handler.rejected["malformed"] == 4
        reply, frames = peer.call(SECRET, _read())  # the real decode still reads it
        assert isinstance(reply, W.ReadReply) and reply.block_ids == HELD and len(frames) == 1
    finally:
        peer.close()
        srv.close()


def test_oversize_heartbeat_and_done_are_refused() -> None:
    leases = _leases()
    srv = kv_server(SECRET, leases, ServerLimits(max_ids_per_message=16))
    peer = RawPeer(srv.port)
    try:
        expiry = leases._leases["r"].expiry
        for msg in (W.Heartbeat(["r"] * 17), W.Done(["r", *map(str, range(16))])):
            reply, _ = peer.call(SECRET, msg)
            assert isinstance(reply, W.Error) and "max_ids_per_message" in reply.message
        # the 200k-id heartbeat of the review
        frames = peer.seal(SECRET, W.Heartbeat([str(i) for i in range(200_000)]))
        tag = frames[0]
        parts = peer.ask(frames, timeout=1.0)
        if parts is not None:  # (or disconnected for its size: refused either way)
            reply, _ = W.open_reply(SECRET, tag, parts)
            assert isinstance(reply, W.Error) and "200000 request ids" in reply.message
        assert leases._leases["r"].expiry == expiry and not leases._leases["r"].finished
        assert srv.alive and srv.handler.rejected["limit"] >= 2
        reply, _ = RawPeer(srv.port).call(SECRET, W.Heartbeat(["r"] * 16))  # at the bound: fine
        assert isinstance(reply, W.Ack) and leases._leases["r"].expiry == expiry  # (30 s > 20)
    finally:
        peer.close()
        srv.close()


def test_a_lease_is_read_at_most_n_times() -> None:
    leases = _leases(max_reads=3)
    srv = kv_server(SECRET, leases)
    peer = RawPeer(srv.port)
    try:
        for _ in range(3):
            reply, _ = peer.call(SECRET, _read())
            assert isinstance(reply, W.ReadReply)
        reply, frames = peer.call(SECRET, _read())
        assert isinstance(reply, W.Error) and frames == []
        assert "read 3 times already" in reply.message and "max_reads_per_lease" in reply.message
        reply, _ = peer.call(SECRET, _read("nope"))  # unknown: an error reply, as ever
        assert isinstance(reply, W.Error) and "no longer holds" in reply.message
        reply, _ = peer.call(SECRET, W.Read("r", 2, 2, 3))  # past the end
        assert isinstance(reply, W.Error) and "a read of blocks" in reply.message
        assert srv.handler.rejected["limit"] == 1
    finally:
        peer.close()
        srv.close()


def test_reads_per_second_are_bounded_per_connection() -> None:
    leases = LeaseTable(30.0, max_reads=100)
    leases.add("r", HELD)
    srv = kv_server(SECRET, leases, ServerLimits(max_reads_per_second=2))
    a, b = RawPeer(srv.port), RawPeer(srv.port)
    try:
        got = [type(a.call(SECRET, _read())[0]) for _ in range(3)]
        assert got == [W.ReadReply, W.ReadReply, W.Error]
        assert isinstance(b.call(SECRET, _read())[0], W.ReadReply)  # another connection
        time.sleep(0.6)  # the bucket refills at 2 per second
        assert isinstance(a.call(SECRET, _read())[0], W.ReadReply)
    finally:
        a.close()
        b.close()
        srv.close()


class _Die(BaseException):
    """Escapes every ``except Exception``: the thread dies as if by a bug we did not foresee."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_server_thread_is_restarted_on_the_same_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    leases = _leases()
    srv = kv_server(SECRET, leases)
    sup = Supervisor(srv, None)
    peer = RawPeer(srv.port)
    port = srv.port
    try:
        assert sup.check().healthy

        def die(sock: object) -> None:
            raise _Die("injected by the test")

        monkeypatch.setattr(srv, "_serve_one", die)
        peer.send([b"anything"])
        deadline = time.monotonic() + 5
        while srv.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.alive
        health = sup.check()
        assert not health.healthy and "died" in health.reason and "injected" in health.reason
        monkeypatch.undo()
        assert not sup.check().healthy  # restarted only after the back-off
        time.sleep(FIRST_DELAY_S + 0.05)
        health = sup.check()
        assert health.healthy and health.restarts == 1 and srv.alive and srv.port == port
        peer.close()
        peer = RawPeer(port)
        reply, frames = peer.call(SECRET, _read())
        assert isinstance(reply, W.ReadReply) and len(frames) == 1
    finally:
        peer.close()
        srv.close()
