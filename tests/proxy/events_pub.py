"""A test-side KV event publisher speaking vLLM's wire protocol: XPUB frames (topic, 8-byte
big-endian sequence number, msgpack batch) and a ROUTER replay socket that answers a start
sequence number with its buffered batches and an END marker. XPUB (not PUB) so a test can
wait until the subscriber is really connected instead of sleeping."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import zmq

from kvferry.kv_events import (
    MEDIUM_GPU,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    encode_batch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    block_size: int,
    parent: int | None = None,
    medium: str | None = MEDIUM_GPU,
    **kw: object,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        **kw,  # type: ignore[arg-type]
    )


class TestPublisher:
    __test__ = False

    def __init__(
        self, topic: str = "", replay: bool = True, endpoints: tuple[str, str | None] | None = None
    ) -> None:
        """``endpoints``: bind there (a restarted instance on its old ports), else anywhere."""
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if endpoints is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self.endpoint = endpoints[0]
            self.pub.bind(self.endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_endpoint: str | None = None
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            if endpoints is None or endpoints[1] is None:
                rport = self.router.bind_to_random_port("tcp://127.0.0.1")
                self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            else:
                self.replay_endpoint = endpoints[1]
                self.router.bind(self.replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        if not self.pub.poll(int(timeout * 1000)):
            raise AssertionError("no subscriber connected")
        self.pub.recv()  # the subscription message

    def payload(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> bytes:
        return encode_batch(KVEventBatch(ts=ts or time.time(), events=list(events)))

    def publish(
        self, events: Sequence[KVCacheEvent], send: bool = True, seq: int | None = None
    ) -> int:
        """Buffer (for replay) and send one batch; ``send=False`` only buffers it (a batch the
        subscriber missed)."""
        with self._lock:
            s = self.seq if seq is None else seq
            self.seq = s + 1
            data = self.payload(events)
            self.buffer.append((s, data))
        if send:
            self.pub.send_multipart([self.topic, s.to_bytes(8, "big"), data])
        return s

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            with self._lock:
                items = [(s, d) for s, d in self.buffer if s >= first]
            for s, d in items:
                self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), d])
            self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)
