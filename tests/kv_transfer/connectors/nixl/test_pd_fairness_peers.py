"""Bounded, fair P/D peer work on the decode side (issue 11): the side-channel client keeps
work per peer address, so forged params naming dead ports (or the real prefill's engine
id at a dead port) delay and fail only themselves; its slots are FIFO, bounded in time
and survive cancellation."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from kvferry.kv_transfer.connectors.nixl.agent import KVLayout
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef
from kvferry.kv_transfer.connectors.pd.peers import PeerClient
from kvferry.kv_transfer.connectors.pd.slots import Slots
from tests.helpers.ports import _dead_port

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


TIMEOUT = 1.0  # handshake_timeout of the client tests
COMPAT = hs.Compat("model=tiny dtype=float32")
LAYOUT = KVLayout(32, 512, 16, "DRAM", 0, (4096,))
INFO = hs.AgentInfo("P", "agent-P", b"md", 0, 1, 16, 32, 512, "DRAM", 0, [8192])


# -- decode side: the side-channel client against stub peers --------------------------------


def _answer(request: hs.PeerRequest, peer: str) -> hs.PeerReply:
    if isinstance(request, hs.HandshakeRequest):
        return INFO
    if isinstance(request, hs.ClaimRequest):
        return hs.Granted("agent-P", 30.0)
    if isinstance(request, hs.HeartbeatRequest):
        return hs.Renewed({r: 30.0 for r in request.request_ids}, [])
    return hs.Ack(1)


@pytest.fixture
def peers():
    ctx = zmq.Context()
    server = hs.SideChannelServer(ctx, "127.0.0.1", 0, hs.Codec(COMPAT), _answer)
    client = PeerClient(
        ctx, hs.Codec(COMPAT), "D", "agent-D", LAYOUT, NixlOptions(handshake_timeout=TIMEOUT)
    )
    yield client, server.port
    client.shutdown()
    server.close()
    ctx.term()


def _spec(port: int, engine_id: str = "P", req: str = "p-1") -> RecvSpec:
    return RecvSpec(
        f"d-{req}", RemoteRef(engine_id, "127.0.0.1", port, req), [1, 2], [3, 4], 20, "d"
    )


def _timed(fut: Future[Any], within: float) -> tuple[Any, float]:
    t0 = time.monotonic()
    try:
        result: Any = fut.result(within)
    except Exception as e:  # the forged work fails; what matters is when
        result = e
    return result, time.monotonic() - t0


def test_failure_cache_is_keyed_by_the_full_address(peers):
    """A forged read naming the real engine id at a dead port must not fail the real one."""
    client, port = peers
    forged = client.prepare(_spec(_dead_port(), req="forged"))
    time.sleep(0.05)  # the forged handshake is in flight
    good, took = _timed(client.prepare(_spec(port)), 2 * TIMEOUT)
    assert isinstance(good, tuple) and good[0] == INFO and took < TIMEOUT / 2, (good, took)
    assert "no answer" in str(_timed(forged, 3 * TIMEOUT)[0])
    # Once the forged address is in the failure cache, the real one still works at once.
    good, took = _timed(client.prepare(_spec(port, req="p-2")), 2 * TIMEOUT)
    assert isinstance(good, tuple) and took < TIMEOUT / 2, (good, took)


def test_dead_peers_delay_only_their_own_work(peers):
    """16 forged engine ids and 24 forged releases at dead ports, then a legitimate read and
    release: those are not delayed, and the forged work ends within its bounded time."""
    client, port = peers
    dead = _dead_port()
    started = time.monotonic()
    forged = [client.prepare(_spec(dead, engine_id=f"forged-{i}")) for i in range(16)]
    released = [
        client.release(RemoteRef(f"gone-{i}", "127.0.0.1", dead, "r"), [1]) for i in range(24)
    ]
    time.sleep(0.05)
    good, took = _timed(client.prepare(_spec(port)), 2 * TIMEOUT)
    assert isinstance(good, tuple) and took < TIMEOUT / 2, (good, took)
    ok, took = _timed(client.release(RemoteRef("P", "127.0.0.1", port, "p-1"), [1, 2]), TIMEOUT)
    assert ok is None and took < TIMEOUT / 2, (ok, took)
    for fut in forged:
        assert "no answer" in str(_timed(fut, 3 * TIMEOUT)[0])
    assert all("no answer" in str(fut.result(3 * TIMEOUT)) for fut in released)
    assert time.monotonic() - started < 2 * TIMEOUT + 1


def test_a_dead_peer_sheds_its_backlog_and_logs_once(peers, caplog):
    client, port = peers
    caplog.set_level(logging.WARNING, "kvferry.kv_transfer.connectors.pd.peer_calls")
    gone = RemoteRef("gone", "127.0.0.1", _dead_port(), "r")
    started = time.monotonic()
    backlog = [client.release(gone, [1]) for _ in range(300)]
    for _ in range(5):
        client.heartbeat([gone])
    ok, took = _timed(client.release(RemoteRef("P", "127.0.0.1", port, "p-1"), [1]), TIMEOUT)
    assert ok is None and took < TIMEOUT / 2
    assert all(isinstance(f.result(3 * TIMEOUT), str) for f in backlog)
    assert time.monotonic() - started < 2 * TIMEOUT + 1  # 300 calls of TIMEOUT each: minutes
    # Once per outage, whichever droppable work (releases or heartbeats) meets it first.
    dropped = [r for r in caplog.records if "P/D: dropping " in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in dropped]
    assert "(engine gone)" in dropped[0].getMessage()


def test_slots_are_fifo_bounded_in_time_and_survive_cancellation():
    async def main() -> None:
        slots = Slots(1)
        assert await slots.take(0.1)
        assert not await slots.take(0.05)  # nobody gave it back in time
        first = asyncio.ensure_future(slots.take(1))
        second = asyncio.ensure_future(slots.take(1))
        await asyncio.sleep(0)
        slots.give()  # handed to the first waiter...
        first.cancel()  # ...which is cancelled before it runs: the slot passes on
        assert await second
        slots.give()
        assert slots.free == 1

    asyncio.run(main())
