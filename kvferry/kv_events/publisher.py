"""Event publishers: where the engine's KV event batches go (vLLM's ``EventPublisher`` family).

:class:`ZmqEventPublisher` speaks vLLM's wire protocol, so subscribers written for vLLM
(llm-d's indexer, Dynamo's router, vLLM's example subscriber) read kvferry unchanged:

- PUB socket, one multipart message per batch: ``topic``, the sequence number as 8 bytes
  big-endian, the MessagePack payload (:func:`kvferry.kv_events.encode_batch`);
- optional ROUTER replay socket: a client sends the first sequence number it wants (8 bytes
  big-endian, after an empty delimiter frame as REQ/DEALER do); every buffered batch from
  there is sent back as ``(empty, topic, seq, payload)``, then ``(empty, b"", END_SEQ, b"")``.

Differences from vLLM, on purpose: ``publish`` never blocks (a full queue drops the batch and
counts it, where vLLM waits); a dropped batch still uses its sequence number, so subscribers
see the gap; a local address (127.0.0.1, localhost, one of this host's addresses) is bound,
where vLLM connects to anything without ``*``.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import count
from typing import Any

import zmq

from kvferry.config.kv_events import KVEventsConfig
from kvferry.kv_events.endpoints import is_bind_endpoint, offset_endpoint_port, tcp_host
from kvferry.kv_events.events import EventBatch, encode_batch
from kvferry.logger import fmt_fields, init_logger

__all__ = [
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherStats",
    "ZmqEventPublisher",
]

logger = init_logger(__name__)

_DROP_LOG_INTERVAL_S = 10.0
_REPLAYS_PER_TURN = 16


@dataclass(frozen=True)
class PublisherStats:
    """Batches sent, dropped (queue full, publisher closed, send or encode error, still queued
    at shutdown), and waiting in the queue now."""

    published: int = 0
    dropped: int = 0
    queued: int = 0


class EventPublisher(ABC):
    """Sends the engine's event batches, one publisher per data-parallel rank.

    Contract: ``publish`` is called from the engine step and never blocks or raises for a
    slow or absent consumer: a batch it cannot take is dropped and counted in ``stats()``.
    Batches leave in ``publish`` order with increasing sequence numbers. A batch without a
    ``data_parallel_rank`` gets the publisher's. ``shutdown`` sends what is queued within a
    bounded time, then releases every resource; it is idempotent and never hangs.
    """

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Queue one batch for sending."""

    @abstractmethod
    def shutdown(self) -> None:
        """Flush (bounded) and release sockets and threads."""

    def stats(self) -> PublisherStats:
        return PublisherStats()

    def get_publisher_config(self) -> KVEventsConfig | None:
        """The configuration in effect (bound endpoints resolved), None when not publishing."""
        return None


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events disabled)."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """vLLM's PUB/ROUTER publisher (see the module docstring); a daemon thread sends.

    ``buffer_steps`` batches are kept for replay, ``hwm`` is the PUB socket's high-water mark
    (ZMQ drops beyond it per subscriber), ``max_queue_size`` bounds the batches waiting for the
    thread. Sockets are bound or connected in the constructor, so an address in use fails
    there; an endpoint with port 0 binds a free port (see ``get_publisher_config()``).
    """

    SHUTDOWN_TIMEOUT: float = 1.0
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        super().__init__(data_parallel_rank)
        self._queue: queue.Queue[tuple[int, EventBatch]] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode("utf-8")
        self._seq = count()
        # Counters each written by one thread only (caller / sender), summed in stats().
        self._dropped_caller = 0
        self._dropped_sender = 0
        self._published = 0
        self._last_drop_log = float("-inf")
        self._closed = False
        self._closing = threading.Event()
        self._abort = threading.Event()

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        endpoint = self.offset_endpoint_port(endpoint, data_parallel_rank) or endpoint
        replay_endpoint = self.offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            bound = is_bind_endpoint(endpoint)
            if bound:
                endpoint = self._bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                replay_endpoint = self._bind(self._replay, replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info(
            fmt_fields(
                "KV events publisher started",
                endpoint=endpoint,
                mode="bind" if bound else "connect",
                replay=replay_endpoint,
                topic=repr(topic),
                dp_rank=data_parallel_rank,
            )
        )

    # -- caller side ----------------------------------------------------------------------

    def publish(self, events: EventBatch) -> None:
        seq = next(self._seq)
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        if self._closed:
            self._note_drop("publisher is shut down")
            return
        try:
            self._queue.put_nowait((seq, events))
        except queue.Full:
            self._note_drop("queue full")

    def _note_drop(self, why: str) -> None:
        self._dropped_caller += 1
        now = time.monotonic()
        if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
            self._last_drop_log = now
            logger.warning(
                fmt_fields("KV event batch dropped", why=why, dropped=self.stats().dropped)
            )

    def stats(self) -> PublisherStats:
        return PublisherStats(
            published=self._published,
            dropped=self._dropped_caller + self._dropped_sender,
            queued=self._queue.qsize(),
        )

    def get_publisher_config(self) -> KVEventsConfig:
        return self._config

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(self.SHUTDOWN_TIMEOUT)
        left = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            left += 1
        self._dropped_caller += left
        if self._thread.is_alive():
            # Sockets belong to the sender thread; closing them under it is unsafe.
            logger.warning("KV events publisher thread did not stop; sockets left open")
        else:
            self._close_sockets()
        stats = self.stats()
        log = logger.warning if left else logger.info
        log(
            fmt_fields(
                "KV events publisher stopped",
                published=stats.published,
                dropped=stats.dropped,
                unsent_at_shutdown=left,
            )
        )

    def _close_sockets(self) -> None:
        # A short linger lets the last frames leave without holding the process at exit.
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=100)

    # -- sender thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._abort.is_set():
            self._serve_replays()
            try:
                seq, batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            self._send(seq, batch)

    def _send(self, seq: int, batch: EventBatch) -> None:
        try:
            payload = encode_batch(batch)
        except Exception:
            self._dropped_sender += 1
            logger.exception(fmt_fields("KV event batch could not be encoded", seq=seq))
            return
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._dropped_sender += 1
            logger.warning(fmt_fields("KV event batch not sent", seq=seq, error=exc))
        else:
            self._published += 1
        # Kept for replay even when the live send failed: a subscriber can still fetch it.
        self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        for _ in range(_REPLAYS_PER_TURN):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning(fmt_fields("KV events replay receive failed", error=exc))
                return
            try:
                self._answer_replay(frames)
            except zmq.ZMQError as exc:
                logger.warning(fmt_fields("KV events replay answer failed", error=exc))

    def _answer_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3:
            # No (identity, empty, start) envelope: there is no one to answer.
            logger.warning(fmt_fields("KV events replay request ignored", frames=len(frames)))
            return
        client, _, start_bytes = frames
        if len(start_bytes) == 8:
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                        flags=zmq.NOBLOCK,
                    )
        else:
            logger.warning(
                fmt_fields("KV events replay request is not 8 bytes", length=len(start_bytes))
            )
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""), flags=zmq.NOBLOCK)

    # -- endpoints ------------------------------------------------------------------------

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
        if endpoint.startswith("tcp://") and ":" in tcp_host(endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        if endpoint.startswith("tcp://"):
            # The port the OS picked for ":0" (or the address as ZMQ resolved it).
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return endpoint

    @staticmethod
    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        return offset_endpoint_port(endpoint, data_parallel_rank)


class EventPublisherFactory:
    """Builds the publisher a ``KVEventsConfig`` names (``null`` or ``zmq``, or registered)."""

    _registry: dict[str, Callable[..., EventPublisher]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: Callable[..., EventPublisher]) -> None:
        if name in cls._registry:
            raise KeyError(f"publisher {name!r} already registered")
        cls._registry[name] = ctor

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        kwargs: dict[str, Any] = asdict(config)
        kind = kwargs.pop("publisher")
        kwargs.pop("enable_kv_cache_events")
        try:
            ctor = cls._registry[kind]
        except KeyError:
            raise ValueError(f"unknown KV event publisher {kind!r}") from None
        return ctor(data_parallel_rank=data_parallel_rank, **kwargs)
