"""Bounded, fair P/D peer work and no busy idle (issue 11).

Decode side: the side-channel client keeps work per peer address, so forged params naming dead
ports (or the real prefill's engine id at a dead port) delay and fail only themselves.
Prefill side: one reader cannot keep more than ``max_reader_share`` of the pool renewed or
claimed. A release through ``AsyncLLM.release_kv_transfer`` returns once the blocks are back.
An idle NIXL agent sleeps, and UCX listens only on the configured (loopback) interface.

The attacks run at small scale against real instances (``tests/helpers/nixl_harness.py``
processes, UCX over loopback); each asserts the legitimate request's latency against its baseline and
that no block leaks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psutil
import pytest
import torch
import zmq

from kvferry import EngineArgs
from kvferry.engine.async_llm import AsyncLLM
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl import handshake as hs
from kvferry.kv_transfer.connectors.nixl.agent import KVLayout, NixlTransport, ucx_net_devices
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.nixl.lease import LeaseTable
from kvferry.kv_transfer.connectors.nixl.metadata import (
    NixlConnectorMetadata,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.nixl.params import token_digest
from kvferry.kv_transfer.connectors.nixl.peers import PeerClient, _Slots
from tests.helpers.nixl_config import nixl_engine_config
from tests.helpers.nixl_instance import (
    Instance,
    assert_all_free,
    fake_params,
    nixl_kv,
    submit_decode,
    submit_prefill,
)
from tests.helpers.scheduler import make_kv_cache_config

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")

TIMEOUT = 1.0  # handshake_timeout of the client tests
COMPAT = hs.Compat("model=tiny dtype=float32")
LAYOUT = KVLayout(32, 512, 16, "DRAM", 0, (4096,))
INFO = hs.AgentInfo("P", "agent-P", b"md", 0, 1, 16, 32, 512, "DRAM", 0, [8192])


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    caplog.set_level(logging.WARNING, "kvferry.kv_transfer.connectors.nixl.peers")
    gone = RemoteRef("gone", "127.0.0.1", _dead_port(), "r")
    started = time.monotonic()
    backlog = [client.release(gone, [1]) for _ in range(300)]
    for _ in range(5):
        client.heartbeat([gone])
    ok, took = _timed(client.release(RemoteRef("P", "127.0.0.1", port, "p-1"), [1]), TIMEOUT)
    assert ok is None and took < TIMEOUT / 2
    assert all(isinstance(f.result(3 * TIMEOUT), str) for f in backlog)
    assert time.monotonic() - started < 2 * TIMEOUT + 1  # 300 calls of TIMEOUT each: minutes
    dropped = [r for r in caplog.records if "dropping releases" in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in dropped]


def test_slots_are_fifo_bounded_in_time_and_survive_cancellation():
    async def main() -> None:
        slots = _Slots(1)
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


# -- prefill side: per-reader limits ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _claim(req_id: str, blocks: list[int], reader: str) -> hs.ClaimRequest:
    return hs.ClaimRequest("P", req_id, blocks, 16 * len(blocks), "d", reader, f"agent-{reader}")


def test_one_reader_cannot_pin_the_pool():
    clock = Clock()
    t = LeaseTable("P", "agent-P", lease_s=10, max_hold_s=60, clock=clock, max_reader_blocks=4)
    for i, blocks in enumerate(([1, 2], [3, 4], [5, 6])):
        t.add(f"r{i}", blocks, 32, "d")
    # An outsider renews everything it can name: only up to its limit.
    renewed = t.heartbeat("P", ["r0", "r1", "r2"], "X", "10.0.0.9")
    assert isinstance(renewed, hs.Renewed) and sorted(renewed.held) == ["r0", "r1"]
    assert t.load_of("X", "10.0.0.9") == 4
    reply = t.claim(_claim("r2", [5, 6], "X"), "10.0.0.9")
    assert isinstance(reply, hs.Refused) and reply.retry and "limit 4" in reply.reason
    # Another reader is not affected, and its claim takes a hold the outsider was renewing.
    assert isinstance(t.claim(_claim("r0", [1, 2], "D"), "10.0.0.2"), hs.Granted)
    assert t.load_of("X", "10.0.0.9") == 2 and t.load_of("D", "10.0.0.2") == 2
    renewed = t.heartbeat("P", ["r0", "r1", "r2"], "X", "10.0.0.9")
    assert isinstance(renewed, hs.Renewed) and sorted(renewed.held) == ["r1", "r2"]
    # Whoever renews, nothing outlives max_hold; then nobody is charged any more.
    while t.num_held():
        clock.t += 5
        t.heartbeat("P", ["r1", "r2"], "X", "10.0.0.9")
        t.heartbeat("P", ["r0"], "D", "10.0.0.2")
        t.reap()
    assert clock.t - 100 <= 60
    assert t.load_of("X", "10.0.0.9") == 0 and t.load_of("D", "10.0.0.2") == 0
    # Many identities renewing one hold: the least recent makes room, so a legitimate
    # renewer always gets in; connections from one host count as one reader.
    t.add("s", [7], 16, "d")
    for i in range(20):
        t.heartbeat("P", ["s"], f"forged-{i}", "10.0.0.9")
    assert t.load_of("forged-0", "10.0.0.9") == 0 and t.load_of("forged-19", "10.0.0.9") == 1
    assert "s" in t.heartbeat("P", ["s"], "D", "10.0.0.2:41000").held  # type: ignore[union-attr]
    assert t.load_of("D", "10.0.0.2:52000") == 1
    # A hold larger than the limit can still be read (by one reader at a time).
    t.add("big", list(range(10, 20)), 160, "d")
    assert isinstance(t.claim(_claim("big", list(range(10, 20)), "E"), "10.0.0.3"), hs.Granted)


# -- no busy idle; UCX binds where configured ------------------------------------------------


def _listening(proc: psutil.Process) -> set[str]:
    return {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_idle_agent_sleeps_and_ucx_listens_only_on_loopback(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert ucx_net_devices("127.0.0.1") == ucx_net_devices("localhost") == "lo"
    assert ucx_net_devices("0.0.0.0") is None and ucx_net_devices("example.org") is None
    proc = psutil.Process()
    before = _listening(proc)
    transport = NixlTransport("idle-test", ["UCX"], bind_host="127.0.0.1")
    try:
        assert "UCX_NET_DEVICES" not in __import__("os").environ  # set only while building
        new = _listening(proc) - before
        assert new and all(ip.startswith("127.") or ip == "::1" for ip in new), new
        time.sleep(0.5)
        t0, w0 = proc.cpu_times(), time.monotonic()
        time.sleep(3)
        t1, w1 = proc.cpu_times(), time.monotonic()
        cpu = (t1.user - t0.user + t1.system - t0.system) / (w1 - w0)
        assert cpu < 0.02, f"an idle NIXL agent uses {cpu:.1%} of a core"
    finally:
        transport.close()


def test_reads_still_work_with_the_derived_ucx_settings(monkeypatch):
    """No UCX_NET_DEVICES from the user: the connector's own (loopback) choice transfers."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    kvc = make_kv_cache_config(32)
    shape = (2, 32, 16, 1, 8)
    src = {"model.layers.0.self_attn": torch.randn(shape)}
    dst = {"model.layers.0.self_attn": torch.zeros(shape)}
    p = NixlConnector(nixl_engine_config("fair-P"), KVConnectorRole.WORKER, kvc)
    d = NixlConnector(nixl_engine_config("fair-D"), KVConnectorRole.WORKER, kvc)
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        pw, dw = p.connector_worker, d.connector_worker
        assert pw is not None and dw is not None
        digest = token_digest(list(range(32)), 32)
        pw.bind(NixlConnectorMetadata(reqs_to_send=[SendSpec("p-1", [3, 4], 32, digest)]))
        ref = RemoteRef("fair-P", "127.0.0.1", pw.port, "p-1")
        spec = RecvSpec("d-1", ref, [3, 4], [7, 9], 32, digest)
        dw.start_load(NixlConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
        got: set[str] = set()
        sent: set[str] = set()
        deadline = time.monotonic() + 20
        while not (got and sent) and time.monotonic() < deadline:
            got |= dw.get_finished()[1]
            sent |= pw.get_finished()[0]
        assert got == {"d-1"} and sent == {"p-1"} and not dw.get_failed_recving()
        s, t = src["model.layers.0.self_attn"], dst["model.layers.0.self_attn"]
        assert torch.equal(t[:, [7, 9]], s[:, [3, 4]])
    finally:
        p.shutdown()
        d.shutdown()


# -- a truthful release ----------------------------------------------------------------------


def test_release_returns_once_the_blocks_are_back(tiny_model_factory):
    """POST /v1/kv/release on the prefill instance itself: when release_kv_transfer returns,
    the held blocks are free (it used to return before the connector even saw the params)."""
    kvt = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_port": 0, "handshake_timeout": 2.0},
    }
    args = EngineArgs(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
        kv_transfer_config=kvt,
    )
    llm = AsyncLLM(args.create_engine_config())

    def free(engine: Any) -> tuple[int, int]:
        return (
            engine.scheduler.kv_cache_manager.get_num_free_blocks(),
            engine.kv_cache_config.num_blocks,
        )

    async def main() -> None:
        from kvferry import SamplingParams

        extra = {"kv_transfer_params": {"do_remote_decode": True}}
        sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args=extra)
        final = None
        async for out in llm.generate({"prompt_token_ids": list(range(3, 60))}, sp):
            final = out
        assert final is not None and final.kv_transfer_params is not None
        held, total = await llm.call(free)
        assert held < total  # the prefill holds its prompt's blocks for a reader
        await llm.release_kv_transfer(final.kv_transfer_params)
        assert await llm.call(free) == (total, total)
        # A release naming a dead peer returns within the connector's bound.
        dead = {**final.kv_transfer_params, "remote_port": _dead_port(), "remote_engine_id": "x"}
        t0 = time.monotonic()
        await llm.release_kv_transfer(dead)
        assert time.monotonic() - t0 < 2 * 2.0 + 2

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


# -- the attacks against real instances ------------------------------------------------------

LEASE_S = 4.0


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fairness-logs")
    model = tiny_model_factory("llama")
    procs = {
        "P": Instance("P", model, nixl_kv("kv_producer"), logs / "P.log"),
        "D": Instance("D", model, nixl_kv("kv_consumer", "fail"), logs / "D.log"),
    }
    try:
        for inst in procs.values():
            inst.ready = inst.wait("ready", 120)  # type: ignore[attr-defined]
        yield procs
    finally:
        for inst in procs.values():
            inst.close()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


def _legit(p: Instance, d: Instance, seeds: list[int], n: int = 64) -> float:
    """Proxied requests decoded at the same time (their prefills done first): the median
    latency of their decodes."""
    prompts = [_prompt(seed, n) for seed in seeds]
    params = [p.wait(submit_prefill(p, prompt))["kv_transfer_params"] for prompt in prompts]

    def decode(prompt: list[int], kv_params: dict[str, Any]) -> float:
        t0 = time.monotonic()
        out = d.wait(submit_decode(d, prompt, kv_params))
        assert out["finish_reason"] == "length" and out["external_cached"] == n, out
        return time.monotonic() - t0

    with ThreadPoolExecutor(len(seeds)) as pool:
        return statistics.median(pool.map(decode, prompts, params))


def _no_leaks(p: Instance, d: Instance) -> None:
    assert_all_free(p, within=LEASE_S * 3)
    assert_all_free(d, within=10)


@pytest.mark.slow
def test_forged_reads_and_releases_at_dead_ports_do_not_delay_the_real_ones(pair):
    p, d = pair["P"], pair["D"]
    base = _legit(p, d, [10, 11, 12])
    real = p.ready["engine_id"]  # type: ignore[attr-defined]
    dead = _dead_port()
    prompt = _prompt(9, 40)
    # The real prefill's engine id at a dead port (it used to fail every read from P for the
    # handshake timeout), 16 forged engine ids, and 24 forged releases.
    forged = [submit_decode(d, prompt, fake_params(prompt, real, dead))]
    forged += [
        submit_decode(d, prompt, fake_params(prompt, f"forged-{i}", dead)) for i in range(16)
    ]
    for i in range(24):
        d.call("release", kv_transfer_params=fake_params(prompt, f"gone-{i}", dead))
    took = _legit(p, d, [13, 14, 15])  # these used to wait behind all the forged work
    assert took < 2 * base + 1.0, (took, base)
    for cid in forged:
        out = d.wait(cid, timeout=10)
        assert out["finish_reason"] == "error", out
    _no_leaks(p, d)


@pytest.mark.slow
def test_an_outsider_cannot_pin_the_prefill_pool(pair):
    """Heartbeats from one outsider keep at most max_reader_share of P's pool (0.5 here)
    held; a legitimate large request still gets its blocks and its decode."""
    p, d = pair["P"], pair["D"]
    total = p.call("status")["num_blocks"]
    held: list[str] = []  # what the outsider renews: it learns each hold as it is made
    stop = threading.Event()
    ctx = zmq.Context()
    codec = hs.Codec(hs.Compat(p.ready["compat"]))  # type: ignore[attr-defined]
    renewed: dict[str, int] = defaultdict(int)

    def outsider() -> None:
        while not stop.wait(0.3):
            beat = hs.HeartbeatRequest(p.ready["engine_id"], list(held), "outsider")  # type: ignore[attr-defined]
            reply = hs.call(ctx, "127.0.0.1", p.ready["port"], codec, beat, 2.0)  # type: ignore[attr-defined]
            if isinstance(reply, hs.Renewed):
                for rid in reply.held:
                    renewed[rid] += 1

    beater = threading.Thread(target=outsider, daemon=True)
    beater.start()
    try:
        # 15 holds of 30 blocks: about 88% of the pool.
        for cid in [submit_prefill(p, _prompt(100 + i, 480)) for i in range(15)]:
            held.append(p.wait(cid)["kv_transfer_params"]["remote_request_id"])
        time.sleep(LEASE_S * 1.5)  # what the outsider could not renew has expired by now
        st = p.call("status")
        assert st["free_blocks"] >= total // 2 - 30, st  # at most half pinned (+ one hold)
        assert 0 < len(renewed) < len(held), renewed  # it did renew, up to its limit
        t0 = time.monotonic()
        _legit(p, d, [20], n=3000)  # 188 blocks: needs what the outsider let go
        assert time.monotonic() - t0 < 30  # it used to wait for kv_lease_max_duration
    finally:
        stop.set()
        beater.join(5)
        ctx.term()
    _no_leaks(p, d)
