"""ZmqEventPublisher: frames and sequence numbers as a real SUB sees them, replay, back-pressure
that never stalls the caller, bad replay requests, bounded shutdown; the factory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvferry.config import KVEventsConfig
from kvferry.kv_events import (
    MEDIUM_GPU,
    BlockStored,
    EventBatch,
    EventPublisherFactory,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
)
from kvferry.kv_events.endpoints import is_bind_endpoint
from tests.kv_events.zmq_helpers import END_SEQ, dealer, recv_live, replay, subscribe

LOCAL = "tcp://127.0.0.1:0"


def batch(n: int, rank: int | None = None) -> KVEventBatch:
    ev = BlockStored([n, n + 1], n - 1 if n else None, list(range(8)), 4, None, MEDIUM_GPU, None)
    return KVEventBatch(ts=float(n), events=[ev], data_parallel_rank=rank)


class GatedPublisher(ZmqEventPublisher):
    """Its sender thread stops at each batch until ``gate`` opens: a consumer that stalls."""

    def __init__(self, **kw: object) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        super().__init__(**kw)  # type: ignore[arg-type]

    def _send(self, seq: int, batch: EventBatch) -> None:
        self.entered.set()
        self.gate.wait(10)
        super()._send(seq, batch)


@pytest.fixture
def publishers() -> Iterator[list[ZmqEventPublisher]]:
    made: list[ZmqEventPublisher] = []
    yield made
    for p in made:
        if isinstance(p, GatedPublisher):
            p.gate.set()
        p.shutdown()


def make(made: list[ZmqEventPublisher], cls: type = ZmqEventPublisher, **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("endpoint", LOCAL)
    kw.setdefault("replay_endpoint", LOCAL)
    pub = cls(**kw)
    made.append(pub)
    return pub


def wait_published(pub: ZmqEventPublisher, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pub.stats().published < n:
        assert time.monotonic() < deadline, pub.stats()
        time.sleep(0.01)


def test_frames_and_sequence_numbers(publishers) -> None:
    pub = make(publishers, topic="kv@a", data_parallel_rank=3)
    endpoint = pub.get_publisher_config().endpoint
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    sub, warm = subscribe(endpoint, "kv@a", pub.publish)
    sent = [batch(1), batch(2, rank=5), batch(3)]
    for b in sent:
        pub.publish(b)
    got = [recv_live(sub) for _ in sent]
    for k, frames in enumerate(got):
        assert frames is not None and len(frames) == 3
        topic, seq, payload = frames
        assert topic == b"kv@a"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == warm + k
        assert payload == encode_batch(sent[k])
        assert decode_batch(payload) == sent[k]
    # A batch without a data-parallel rank gets the publisher's; a set one is kept.
    assert [decode_batch(f[2]).data_parallel_rank for f in got if f] == [3, 5, 3]
    sub.close(0)


def test_topic_filter(publishers) -> None:
    pub = make(publishers, topic="mine")
    sub, _ = subscribe(pub.get_publisher_config().endpoint, "mine", pub.publish)
    other: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    other.connect(pub.get_publisher_config().endpoint)
    other.setsockopt_string(zmq.SUBSCRIBE, "theirs")
    time.sleep(0.2)
    pub.publish(batch(1))
    assert recv_live(sub) is not None and not other.poll(200)
    sub.close(0)
    other.close(0)


def test_replay_from_a_sequence_number(publishers) -> None:
    pub = make(publishers, buffer_steps=8, topic="t")
    for n in range(20):
        pub.publish(batch(n))
    wait_published(pub, 20)
    client = dealer(pub.get_publisher_config().replay_endpoint or "")
    got = replay(client, (15).to_bytes(8, "big"))
    assert got[-1] == [b"", END_SEQ, b""]
    assert [int.from_bytes(f[1], "big") for f in got[:-1]] == [15, 16, 17, 18, 19]
    assert all(f[0] == b"t" for f in got[:-1])
    assert [decode_batch(f[2]).ts for f in got[:-1]] == [15.0, 16.0, 17.0, 18.0, 19.0]
    # From before the buffer's start: everything still buffered (the last 8).
    got = replay(client, (0).to_bytes(8, "big"))
    assert [int.from_bytes(f[1], "big") for f in got[:-1]] == list(range(12, 20))
    # From after the newest: only the end marker.
    assert replay(client, (99).to_bytes(8, "big")) == [[b"", END_SEQ, b""]]
    client.close(0)


def test_bad_replay_requests_leave_the_thread_working(publishers) -> None:
    pub = make(publishers, topic="t")
    pub.publish(batch(0))
    wait_published(pub, 1)
    endpoint = pub.get_publisher_config().replay_endpoint or ""
    client = dealer(endpoint)
    # Wrong length: answered with the end marker alone.
    assert replay(client, b"abc") == [[b"", END_SEQ, b""]]
    assert replay(client, b"\x00" * 9) == [[b"", END_SEQ, b""]]
    # No envelope, or extra frames: ignored (nothing comes back).
    raw = dealer(endpoint)
    raw.send((0).to_bytes(8, "big"))
    raw.send_multipart([b"", b"x", b"garbage", b"more"])
    assert not raw.poll(300)
    # The replay socket and the live stream both still work.
    got = replay(client, (0).to_bytes(8, "big"))
    assert [int.from_bytes(f[1], "big") for f in got[:-1]] == [0]
    pub.publish(batch(1))
    wait_published(pub, 2)
    assert pub._thread.is_alive()
    client.close(0)
    raw.close(0)


def test_full_queue_drops_and_counts_without_blocking(publishers) -> None:
    pub = make(publishers, cls=GatedPublisher, max_queue_size=100, topic="t")
    pub.gate.set()
    sub, warm = subscribe(pub.get_publisher_config().endpoint, "t", pub.publish)
    wait_published(pub, warm)
    pub.gate.clear()
    pub.entered.clear()
    pub.publish(batch(0))
    assert pub.entered.wait(5)  # the sender holds batch 0 and waits at the gate
    pub.entered.clear()
    worst = 0.0
    for n in range(1, 5001):
        t0 = time.perf_counter()
        pub.publish(batch(n))
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.5, worst  # generous: vLLM's publisher would block here for good
    stats = pub.stats()
    assert (stats.queued, stats.dropped) == (100, 4900)
    pub.gate.set()
    wait_published(pub, warm + 101)
    assert pub.stats().dropped == 4900 and pub.stats().queued == 0
    # The dropped batches used their sequence numbers: the next one shows the gap.
    pub.publish(batch(9999))
    seqs = []
    while True:
        frames = recv_live(sub)
        assert frames is not None
        seqs.append(int.from_bytes(frames[1], "big"))
        if decode_batch(frames[2]).ts == 9999.0:
            break
    assert seqs == list(range(warm, warm + 101)) + [warm + 5001]
    sub.close(0)


def test_slow_subscriber_never_stalls_publish(publishers) -> None:
    pub = make(publishers, hwm=10, max_queue_size=200, topic="t")
    sub, warm = subscribe(pub.get_publisher_config().endpoint, "t", pub.publish)
    sub.setsockopt(zmq.RCVHWM, 10)
    worst, total = 0.0, 3000
    for n in range(total):  # the subscriber reads nothing meanwhile
        t0 = time.perf_counter()
        pub.publish(batch(n))
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.5, worst
    deadline = time.monotonic() + 10
    while pub.stats().queued:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stats = pub.stats()
    assert stats.published + stats.dropped == total + warm
    sub.close(0)


def test_shutdown_flushes_what_is_queued(publishers) -> None:
    pub = make(publishers, topic="t")
    sub, warm = subscribe(pub.get_publisher_config().endpoint, "t", pub.publish)
    for n in range(200):
        pub.publish(batch(n))
    pub.shutdown()
    assert pub.stats().published == 200 + warm and pub.stats().dropped == 0
    got = [recv_live(sub, 2000) for _ in range(200)]
    assert [decode_batch(f[2]).ts for f in got if f] == [float(n) for n in range(200)]
    pub.publish(batch(1))  # after shutdown: dropped, counted, no exception
    assert pub.stats().dropped == 1
    pub.shutdown()  # idempotent
    sub.close(0)


def test_shutdown_is_bounded_when_the_sender_is_stuck(publishers) -> None:
    pub = make(publishers, cls=GatedPublisher, topic="t")
    pub.SHUTDOWN_TIMEOUT = 0.2
    pub.publish(batch(0))
    assert pub.entered.wait(5)
    for n in range(1, 11):
        pub.publish(batch(n))
    t0 = time.monotonic()
    pub.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert pub.stats().dropped == 10 and pub.stats().queued == 0
    pub.gate.set()
    pub._thread.join(5)
    assert not pub._thread.is_alive()


def test_connect_mode_for_a_remote_host(publishers) -> None:
    # TEST-NET-1: not this host, so the PUB connects (the subscriber would bind), as vLLM does.
    pub = make(publishers, endpoint="tcp://192.0.2.1:5557", replay_endpoint=None)
    assert pub.get_publisher_config().endpoint == "tcp://192.0.2.1:5557"
    for n in range(50):
        pub.publish(batch(n))
    wait_published(pub, 50)


def test_bind_or_connect_decision() -> None:
    for endpoint in (
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://127.0.0.1:5557",
        "tcp://localhost:5557",
        "tcp://[::1]:5557",
        "ipc:///tmp/kv.sock",
        "inproc://kv",
    ):
        assert is_bind_endpoint(endpoint), endpoint
    for endpoint in ("tcp://192.0.2.1:5557", "tcp://indexer.example.invalid:5557"):
        assert not is_bind_endpoint(endpoint), endpoint


def test_offset_endpoint_port_per_data_parallel_rank() -> None:
    off = ZmqEventPublisher.offset_endpoint_port
    assert off("tcp://*:5557", 0) == "tcp://*:5557"
    assert off("tcp://*:5557", 2) == "tcp://*:5559"
    assert off("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert off("inproc://cache", 1) == "inproc://cache_dp1"
    assert off(None, 1) is None
    with pytest.raises(ValueError):
        off("ipc:///tmp/x", 1)


def test_factory(publishers) -> None:
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)
    assert isinstance(EventPublisherFactory.create(KVEventsConfig()), NullEventPublisher)
    null = EventPublisherFactory.create(
        KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    )
    assert isinstance(null, NullEventPublisher)
    null.publish(batch(0))
    assert null.stats().published == 0 and null.get_publisher_config() is None
    null.shutdown()
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=LOCAL,
        replay_endpoint=LOCAL,
        buffer_steps=5,
        hwm=7,
        max_queue_size=9,
        topic="x",
    )
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=1)
    assert isinstance(pub, ZmqEventPublisher)
    publishers.append(pub)
    resolved = pub.get_publisher_config()
    assert (resolved.buffer_steps, resolved.hwm, resolved.max_queue_size, resolved.topic) == (
        5,
        7,
        9,
        "x",
    )
    assert resolved.publishes and resolved.replay_endpoint != LOCAL
    with pytest.raises(KeyError):
        EventPublisherFactory.register_publisher("zmq", ZmqEventPublisher)


def test_address_in_use_fails_in_the_constructor(publishers) -> None:
    pub = make(publishers, replay_endpoint=None)
    with pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(endpoint=pub.get_publisher_config().endpoint)
