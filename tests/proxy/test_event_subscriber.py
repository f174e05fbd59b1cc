"""KVEventSubscriber against a real ZMQ publisher speaking vLLM's protocol: live batches,
replay of gaps, a restarted publisher, bad frames, resync."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvferry.entrypoints.proxy.event_subscriber import EventSource, KVEventSubscriber
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics
from kvferry.kv_events import AllBlocksCleared
from tests.helpers.servers import wait_for
from tests.proxy.events_pub import TestPublisher, stored

BS = 4
A = "http://a"


def blocks(n: int, base: int = 0) -> tuple[list[int], list[int]]:
    """n chained blocks: hashes base+1.., tokens base*100.."""
    return [base + i + 1 for i in range(n)], list(range(base * 100, base * 100 + n * BS))


def val(m: RoutingMetrics, name: str, **labels: str) -> float:
    return m.decisions._registry.get_sample_value(name, labels) or 0.0  # type: ignore[attr-defined]


class Rig:
    def __init__(self, replay: bool = True, topic: str = "kv") -> None:
        self.pub = TestPublisher(topic=topic, replay=replay)
        self.index = PrefixIndex()
        self.registry = CollectorRegistry()
        self.metrics = RoutingMetrics(self.registry)
        self.dropped: list[str] = []
        src = EventSource(A, self.pub.endpoint, self.pub.replay_endpoint, topic)
        self.sub = KVEventSubscriber(
            self.index, [src], self.metrics, replay_timeout=2.0, on_drop=self.dropped.append
        )

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, {"instance": A, **labels}) or 0.0

    def start(self) -> None:
        self.sub.start()
        self.pub.wait_subscribed()
        # With replay, also the one asked for on the SUB's connect event: one still in flight
        # would hold the next live frames back and could overtake them.
        st = self.sub._states[A]
        wait_for(
            lambda: (st.connects >= 1 or not st.src.replay_endpoint) and self.sub.synced(A),
            what="the initial replays",
        )

    def matched(self, tokens: list[int]) -> int:
        return self.index.match(A, tokens).blocks

    def close(self) -> None:
        self.sub.close()
        self.pub.close()


@pytest.fixture()
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_initial_replay_then_live_batches(rig: Rig) -> None:
    h, t = blocks(2)
    rig.pub.publish([stored(h, t, BS)], send=False)  # before the proxy subscribed
    rig.start()
    # The replay asked for with the socket, and maybe one more when the SUB connected.
    assert set(rig.pub.replay_requests) == {0}
    wait_for(lambda: rig.matched(t) == 2, what="the replayed batch")
    h2, t2 = blocks(1, base=7)
    rig.pub.publish([stored(h2, t2, BS)])
    wait_for(lambda: rig.matched(t2) == 1, what="the live batch")
    assert rig.sub.last_seq(A) == 1
    assert rig.metric("kvferry_proxy_kv_event_batches_total", source="replay") == 1
    assert rig.metric("kvferry_proxy_kv_event_batches_total", source="live") == 1
    assert rig.metric("kvferry_proxy_kv_index_blocks") == 3
    assert 0 <= rig.metric("kvferry_proxy_kv_event_lag_seconds") < 5


def test_a_gap_is_replayed_before_later_batches(rig: Rig) -> None:
    rig.start()
    h, t = blocks(1)
    rig.pub.publish([stored(h, t, BS)], send=False)  # seq 0, missed
    rig.pub.publish([AllBlocksCleared()], send=False)  # seq 1, missed
    h2, t2 = blocks(1, base=5)
    rig.pub.publish([stored(h2, t2, BS)])  # seq 2: must apply after the clear
    wait_for(lambda: rig.sub.last_seq(A) == 2, what="the gap to be replayed")
    assert set(rig.pub.replay_requests) == {0} and len(rig.pub.replay_requests) >= 2
    assert rig.matched(t) == 0 and rig.matched(t2) == 1
    assert rig.metric("kvferry_proxy_kv_event_batches_total", source="replay") == 3
    h3, t3 = blocks(1, base=9)
    rig.pub.publish([stored(h3, t3, BS)], send=False)
    rig.pub.publish([])
    wait_for(lambda: rig.matched(t3) == 1, what="the second gap")
    assert rig.pub.replay_requests[-1] == 3
    assert rig.metric("kvferry_proxy_kv_event_gaps_total", outcome="replayed") >= 1
    assert rig.metric("kvferry_proxy_kv_event_gaps_total", outcome="lost") == 0


def test_a_restarted_publisher_drops_the_index_and_replays_from_zero(rig: Rig) -> None:
    rig.start()
    for i in range(3):
        h, t = blocks(1, base=i)
        rig.pub.publish([stored(h, t, BS)])
    wait_for(lambda: rig.sub.last_seq(A) == 2, what="three batches")
    # The instance restarts: its publisher counts from 0 again, and we missed its first batch.
    rig.pub.buffer.clear()
    h, t = blocks(1, base=40)
    rig.pub.publish([stored(h, t, BS)], send=False, seq=0)
    h2, t2 = blocks(1, base=41)
    rig.pub.publish([stored(h2, t2, BS)], seq=1)
    wait_for(lambda: rig.matched(t2) == 1, what="the new publisher's batches")
    assert rig.matched(t) == 1, "the restarted publisher's first batch comes by replay"
    assert rig.matched(blocks(1, base=0)[1]) == 0, "the old process's blocks are gone"
    assert rig.metric("kvferry_proxy_kv_index_resyncs_total", cause="restart") == 1
    assert rig.dropped == [A] and rig.pub.replay_requests[-1] == 0


def test_bad_frames_are_counted_and_dropped(rig: Rig) -> None:
    rig.start()
    rig.pub.send_raw([b"kv", b"short", b"x"])
    rig.pub.send_raw([b"kv", (0).to_bytes(8, "big")])
    rig.pub.send_raw([b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
    h, t = blocks(1)
    rig.pub.seq = 1
    rig.pub.publish([stored(h, t, BS)])
    wait_for(lambda: rig.matched(t) == 1, what="the good batch after the bad ones")
    assert rig.metric("kvferry_proxy_kv_event_errors_total", kind="bad_frame") == 2
    assert rig.metric("kvferry_proxy_kv_event_errors_total", kind="decode") == 1
    assert rig.sub._thread is not None and rig.sub._thread.is_alive()


def test_resync_rebuilds_from_the_replay_buffer(rig: Rig) -> None:
    rig.start()
    h, t = blocks(2)
    rig.pub.publish([stored(h, t, BS)])
    wait_for(lambda: rig.matched(t) == 2, what="the batch")
    asked = len(rig.pub.replay_requests)
    rig.sub.resync(A)
    wait_for(lambda: len(rig.pub.replay_requests) > asked, what="the resync's replay")
    wait_for(lambda: rig.sub.synced(A) and rig.matched(t) == 2, what="the rebuilt index")
    assert rig.metric("kvferry_proxy_kv_index_resyncs_total", cause="reconnect") == 1


def test_lost_events_without_replay_drop_the_index() -> None:
    rig = Rig(replay=False, topic="")
    try:
        rig.start()
        h, t = blocks(1)
        rig.pub.publish([stored(h, t, BS)])
        wait_for(lambda: rig.matched(t) == 1, what="the batch")
        rig.pub.publish([], send=False)
        h2, t2 = blocks(1, base=3)
        rig.pub.publish([stored(h2, t2, BS)])
        wait_for(lambda: rig.matched(t2) == 1, what="the batch after the gap")
        assert rig.matched(t) == 0, "a lost batch may have removed it: dropped"
        assert rig.metric("kvferry_proxy_kv_event_gaps_total", outcome="lost") == 1
    finally:
        rig.close()


def test_batches_published_before_the_sub_reconnected_are_replayed(rig: Rig) -> None:
    rig.start()
    h, t = blocks(1)
    rig.pub.publish([stored(h, t, BS)])
    wait_for(lambda: rig.matched(t) == 1, what="the batch")
    # The instance restarts on the same ports; the proxy resyncs as soon as it sees it up,
    # and the new process publishes before the SUB socket has reconnected: that batch never
    # arrives live, and nothing comes after it to reveal the gap.
    old = rig.pub
    eps = (old.endpoint, old.replay_endpoint)
    old.close()
    rig.pub = TestPublisher(topic="kv", endpoints=eps)
    rig.sub.resync(A)
    wait_for(lambda: rig.sub.synced(A) and rig.matched(t) == 0, what="the resync")
    h2, t2 = blocks(1, base=20)
    rig.pub.publish([stored(h2, t2, BS)])
    wait_for(lambda: rig.matched(t2) == 1, timeout=10, what="the batch the SUB missed")
