"""Small ZMQ clients for the publisher tests: a SUB that waits until it is really subscribed,
and a DEALER that asks the replay socket for batches from a sequence number."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvferry.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def warm_batch(n: int) -> KVEventBatch:
    """A marker batch (negative ts) sent until a new subscriber receives one."""
    return KVEventBatch(ts=-1.0 - n, events=[])


def subscribe(
    endpoint: str, topic: str, publish: Callable[[KVEventBatch], None], timeout: float = 10.0
) -> tuple[zmq.Socket[bytes], int]:
    """A SUB connected to ``endpoint`` that has received one marker batch (ZMQ drops what is
    published before a subscription arrives); returns it and the markers sent."""
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    deadline = time.monotonic() + timeout
    sent = 0
    while time.monotonic() < deadline:
        publish(warm_batch(sent))
        sent += 1
        if sub.poll(50):
            return sub, sent
    raise AssertionError(f"no message reached a subscriber on {endpoint}")


def recv_live(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
    """The next non-marker message, or None on timeout."""
    from kvferry.kv_events import decode_batch

    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        if not sub.poll(50):
            continue
        frames = sub.recv_multipart()
        if decode_batch(frames[2]).ts >= 0:
            return frames
    return None


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def replay(sock: zmq.Socket[bytes], request: bytes, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Send one request (after the empty delimiter, as REQ does); every reply frame set
    (without the delimiter) up to and including the END_SEQ one."""
    sock.send_multipart([b"", request])
    replies = []
    while sock.poll(timeout_ms):
        frames = sock.recv_multipart()
        assert frames[0] == b""
        replies.append(frames[1:])
        if frames[2] == END_SEQ:
            return replies
    raise AssertionError(f"replay answered {len(replies)} frames and no END_SEQ")
