"""KVEventSubscriber: follows every instance's KV event stream into the PrefixIndex.

One background thread holds a ZMQ SUB socket per instance (frames: topic, 8-byte big-endian
sequence number, msgpack ``KVEventBatch``, as vLLM publishes them) and, when the instance has a
replay endpoint, a DEALER socket per replay request (it sends the first wanted sequence number;
the publisher answers with its buffered batches from there, then an END marker). Sequence
rules per instance:

- next number: applied;
- a gap: the missing batches are asked for and applied first (live batches wait meanwhile);
  what the publisher no longer has is lost: that instance's index is dropped, since it may
  hold removals we never saw;
- a number not above the last one on the live stream: the publisher restarted; the index is
  dropped and rebuilt from the new publisher's replay (from 0);
- ``resync(instance)`` (the proxy saw the instance come back after being down) does the same;
- the SUB socket (re)connected: batches published while it was not connected (a restarted
  publisher's first ones, or during a network blip) never arrive live, and no later batch
  may come to reveal the gap, so the batches from the next expected number are asked for.

Bad frames and undecodable payloads are counted and dropped; nothing here raises into the
proxy. An instance is *synced* except while a replay for it is in flight.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.entrypoints.proxy.routing_metrics import RoutingMetrics
from kvferry.kv_events import decode_batch
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MAX_PENDING = 10_000
_DRAIN = 1_000


@dataclass(frozen=True)
class EventSource:
    """Where one instance publishes: ``endpoint`` (PUB) and optionally its replay ROUTER."""

    instance: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class _State:
    src: EventSource
    sub: zmq.Socket | None = None
    monitor: zmq.Socket | None = None
    connects: int = 0
    dealer: zmq.Socket | None = None
    last_seq: int | None = None
    replay_from: int = 0
    replay_gap: bool = False
    replay_deadline: float | None = None
    pending: collections.deque[tuple[int, bytes]] = field(
        default_factory=lambda: collections.deque(maxlen=_MAX_PENDING)
    )


class KVEventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        sources: Sequence[EventSource],
        metrics: RoutingMetrics,
        replay_timeout: float = 3.0,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self._on_drop = on_drop
        self._states = {s.instance: _State(s) for s in sources}
        self._commands: collections.deque[tuple[str, str]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvferry-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def synced(self, instance: str) -> bool:
        st = self._states.get(instance)
        return st is not None and st.replay_deadline is None

    def last_seq(self, instance: str) -> int | None:
        st = self._states.get(instance)
        return st.last_seq if st else None

    def resync(self, instance: str, cause: str = "reconnect") -> None:
        """Drop ``instance``'s index and rebuild it from its replay buffer (any thread)."""
        if instance in self._states:
            self._commands.append((instance, cause))

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        try:
            for st in self._states.values():
                st.sub = self._ctx.socket(zmq.SUB)
                st.sub.setsockopt(zmq.LINGER, 0)
                st.sub.setsockopt(zmq.SUBSCRIBE, st.src.topic.encode())
                if st.src.replay_endpoint:
                    st.monitor = st.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
                    self._poller.register(st.monitor, zmq.POLLIN)
                st.sub.connect(st.src.endpoint)
                self._poller.register(st.sub, zmq.POLLIN)
                if st.src.replay_endpoint:
                    self._start_replay(st, 0, gap=False)
            while not self._stop.is_set():
                self._loop_once()
        except Exception:  # never take the proxy down; routing falls back without events
            logger.exception("kv event subscriber stopped")
            for st in self._states.values():
                st.replay_deadline = time.monotonic() + 1e9  # unsynced: kv_aware falls back
        finally:
            self._ctx.destroy(linger=0)

    def _loop_once(self) -> None:
        while self._commands:
            instance, cause = self._commands.popleft()
            self._drop(self._states[instance], cause)
        ready = dict(self._poller.poll(50))
        for st in self._states.values():
            if st.monitor is not None and st.monitor in ready:
                self._on_monitor(st)
            if st.sub is not None and st.sub in ready:
                for frames in self._drain(st.sub):
                    self._on_live(st, frames)
            if st.dealer is not None and st.dealer in ready:
                for frames in self._drain(st.dealer):
                    self._on_replay(st, frames)
                    if st.dealer is None:
                        break
            if st.replay_deadline is not None and time.monotonic() > st.replay_deadline:
                logger.warning(fmt_fields("kv event replay timed out", instance=st.src.instance))
                self._finish_replay(st, complete=False)

    def _on_monitor(self, st: _State) -> None:
        assert st.monitor is not None
        while True:
            try:
                event = recv_monitor_message(st.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event.get("event") != zmq.EVENT_CONNECTED:
                continue
            # Every connection, the first included: the publisher may have started after the
            # replay asked for with the socket (duplicates are skipped by sequence number).
            st.connects += 1
            start = 0 if st.last_seq is None else st.last_seq + 1
            self._start_replay(st, start, gap=st.last_seq is not None)

    @staticmethod
    def _drain(sock: zmq.Socket) -> list[list[bytes]]:
        out: list[list[bytes]] = []
        while len(out) < _DRAIN:
            try:
                out.append(sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return out

    def _bad(self, st: _State, kind: str) -> None:
        self.metrics.event_errors.labels(st.src.instance, kind).inc()

    def _on_live(self, st: _State, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(st, "bad_frame")
            return
        seq = int.from_bytes(frames[1], "big")
        if st.replay_deadline is not None:
            st.pending.append((seq, frames[2]))
            return
        last = st.last_seq
        if last is not None and seq <= last:
            logger.info(fmt_fields("kv event publisher restarted", instance=st.src.instance))
            self._drop(st, "restart", keep_replay=seq == 0)
            if st.replay_deadline is not None:
                st.pending.append((seq, frames[2]))
                return
        elif st.src.replay_endpoint and seq > (0 if last is None else last + 1):
            # Missed batches; with no batch seen yet, those since the publisher started.
            self._start_replay(st, 0 if last is None else last + 1, gap=True)
            st.pending.append((seq, frames[2]))
            return
        self._accept(st, seq, frames[2], "live")

    def _accept(self, st: _State, seq: int, payload: bytes, source: str) -> None:
        last = st.last_seq
        if last is not None and seq <= last:
            return  # already applied (replay overlap)
        if last is not None and seq > last + 1:
            self.metrics.event_gaps.labels(st.src.instance, "lost").inc(seq - last - 1)
            self._forget(st)
        self._apply(st, seq, payload, source)

    def _apply(self, st: _State, seq: int, payload: bytes, source: str) -> None:
        st.last_seq = seq
        try:
            batch = decode_batch(payload)
        except Exception:
            self._bad(st, "decode")
            return
        try:
            self.index.apply(st.src.instance, batch)
        except Exception:  # a well-formed batch with odd values: drop it, keep the stream
            self._bad(st, "decode")
            return
        m, inst = self.metrics, st.src.instance
        m.event_batches.labels(inst, source).inc()
        m.event_lag.labels(inst).set(max(0.0, time.time() - batch.ts))
        m.index_blocks.labels(inst).set(self.index.size(inst))

    # -- replay -------------------------------------------------------------------------------

    def _start_replay(self, st: _State, start: int, gap: bool) -> None:
        assert self._ctx is not None
        self._close_dealer(st)
        st.dealer = self._ctx.socket(zmq.DEALER)
        st.dealer.setsockopt(zmq.LINGER, 0)
        assert st.src.replay_endpoint is not None
        st.dealer.connect(st.src.replay_endpoint)
        st.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self._poller.register(st.dealer, zmq.POLLIN)
        st.replay_from, st.replay_gap = start, gap
        st.replay_deadline = time.monotonic() + self.replay_timeout

    def _close_dealer(self, st: _State) -> None:
        if st.dealer is not None:
            self._poller.unregister(st.dealer)
            st.dealer.close(linger=0)
            st.dealer = None

    def _on_replay(self, st: _State, frames: list[bytes]) -> None:
        if len(frames) != 4 or len(frames[2]) != 8:
            self._bad(st, "bad_frame")
            return
        if frames[2] == END_SEQ:
            self._finish_replay(st, complete=True)
            return
        seq = int.from_bytes(frames[2], "big")
        expected = st.replay_from if st.last_seq is None else st.last_seq + 1
        if seq > expected and st.last_seq is None:
            # The buffer no longer starts at 0: events from before it are gone, nothing to drop.
            self.metrics.event_gaps.labels(st.src.instance, "lost").inc(seq - expected)
            st.last_seq = seq - 1
        elif st.replay_gap and seq == expected:
            self.metrics.event_gaps.labels(st.src.instance, "replayed").inc()
        self._accept(st, seq, frames[3], "replay")

    def _finish_replay(self, st: _State, complete: bool) -> None:
        self._close_dealer(st)
        st.replay_deadline = None
        pending = list(st.pending)
        st.pending.clear()
        for seq, payload in pending:
            self._accept(st, seq, payload, "live")
        if not complete and st.replay_gap:
            logger.warning(fmt_fields("kv events lost", instance=st.src.instance))

    # -- dropping -------------------------------------------------------------------------------

    def _forget(self, st: _State) -> None:
        self.index.drop(st.src.instance)
        self.metrics.index_blocks.labels(st.src.instance).set(0)
        if self._on_drop is not None:
            self._on_drop(st.src.instance)

    def _drop(self, st: _State, cause: str, keep_replay: bool = False) -> None:
        """Start over for ``st``: its publisher restarted or came back."""
        self.metrics.resyncs.labels(st.src.instance, cause).inc()
        self._forget(st)
        st.last_seq = None
        st.pending.clear()
        if st.src.replay_endpoint and not keep_replay:
            self._start_replay(st, 0, gap=False)
