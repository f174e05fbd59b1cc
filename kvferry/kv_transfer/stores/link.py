"""``StoreLink``: a store client's connection, kept up in the background.

It connects at start (waiting briefly for the first attempt), then probes the master every
``interval_s``: a client that could not connect retries its setup, one whose master stopped
answering is marked down until it answers again (Mooncake's client reconnects to a master
that comes back on the same address by itself). Callers read :attr:`up` to skip calls that
would only block on a dead master, and report failures they meet with :meth:`report_failure`.
Each change of state is logged once, not per call.
"""

from __future__ import annotations

import threading

from kvferry.kv_transfer.stores.mooncake_client import MooncakeStoreClient
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)

FIRST_CONNECT_WAIT_S = 10.0


class StoreLink:
    def __init__(self, client: MooncakeStoreClient, name: str, interval_s: float) -> None:
        self.client = client
        self.name = name
        self.interval_s = interval_s
        self._up = False
        self._announced: bool | None = None  # the state last logged
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-link", daemon=True)
        self.reconnects = 0

    @property
    def up(self) -> bool:
        return self._up

    def start(self) -> bool:
        """Start the background loop; True when the first connection attempt succeeded."""
        self._thread.start()
        self._first.wait(FIRST_CONNECT_WAIT_S)
        return self._up

    def _set(self, up: bool, reason: str = "") -> None:
        self._up = up
        if self._announced == up:
            return
        self._announced = up
        master = self.client.config.master_server_address
        if up:
            logger.info(fmt_fields(f"{self.name}: Mooncake store reachable", master=master))
        else:
            logger.warning(
                fmt_fields(
                    f"{self.name}: Mooncake store unreachable; lookups miss and stores are "
                    "skipped until it answers again (retrying in the background)",
                    master=master,
                    reason=reason or None,
                )
            )

    def report_failure(self, reason: str) -> None:
        """A call failed the way an unreachable master fails."""
        if self._up:
            self.reconnects += 1
        self._set(False, reason)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.client.connected:
                why = self.client.setup()
                self._set(why is None, why or "")
            else:
                ok = self.client.probe()
                self._set(ok, "" if ok else "the master does not answer")
            self._first.set()
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
