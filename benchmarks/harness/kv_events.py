"""A KV-events subscriber for benchmarks: what a router on the stream costs and sees."""

from __future__ import annotations

import threading


class EventCounter:
    """A subscriber on the events-on instance (a router would be one), counting batches."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self._sock.recv_multipart()
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()
