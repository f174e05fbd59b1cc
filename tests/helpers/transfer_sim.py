"""The workers' side of a :class:`~tests.helpers.scripted_connector.ScriptedConnector`'s
transfers: step-output makers to pass as ``step(..., kv_output=...)``, which report loads and
delayed frees as finished (after a fixed or a random number of steps) or some blocks as bad."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import cast

from kvferry.core.scheduler import Scheduler
from kvferry.request import Request, RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput
from tests.helpers.scheduler import table
from tests.helpers.scripted_connector import ScriptedConnector, ScriptedMeta

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class TransferSim:
    """The workers' side of transfers: reports every async load the connector started as
    finished_recving, and every delayed free as finished_sending, ``delay`` steps after it
    began (0: in the step that starts it). Pass it as ``step(..., kv_output=sim)``."""

    def __init__(self, conn: ScriptedConnector, delay: int = 0) -> None:
        self.conn, self.delay = conn, delay
        self._seen_loads = self._seen_sends = 0
        self._recv: dict[str, int] = {}
        self._send: dict[str, int] = {}

    def __call__(self, so: SchedulerOutput) -> KVConnectorOutput:
        for rid in self.conn.async_started[self._seen_loads :]:
            self._recv[rid] = self.delay
        for rid in self.conn.delayed[self._seen_sends :]:
            self._send[rid] = self.delay
        self._seen_loads, self._seen_sends = len(self.conn.async_started), len(self.conn.delayed)
        return KVConnectorOutput(
            finished_recving=self._due(self._recv) or None,
            finished_sending=self._due(self._send) or None,
        )

    @staticmethod
    def _due(pending: dict[str, int]) -> set[str]:
        due = {rid for rid, left in pending.items() if left <= 0}
        for rid in list(pending):
            pending[rid] -= 1
            if rid in due:
                del pending[rid]
        return due


class RandomTransfers:
    """Workers with random transfer times that sometimes fail loads (whole loads via
    failed_recving, or single blocks, async or sync)."""

    def __init__(self, s: Scheduler, conn: ScriptedConnector, rng: random.Random) -> None:
        self.s, self.conn, self.rng = s, conn, rng
        self._seen_loads = self._seen_sends = 0
        self._recv: dict[str, int] = {}
        self._send: dict[str, int] = {}

    def __call__(self, so: SchedulerOutput) -> KVConnectorOutput:
        rng, conn = self.rng, self.conn
        for rid in conn.async_started[self._seen_loads :]:
            self._recv[rid] = rng.randint(0, 3)
        for rid in conn.delayed[self._seen_sends :]:
            self._send[rid] = rng.randint(0, 3)
        self._seen_loads, self._seen_sends = len(conn.async_started), len(conn.delayed)
        out = KVConnectorOutput(
            finished_recving=TransferSim._due(self._recv) or None,
            finished_sending=TransferSim._due(self._send) or None,
        )
        loads = cast(ScriptedMeta, so.kv_connector_metadata).loads
        suspects = [rid for rid in out.finished_recving or ()] + [rid for rid, _ in loads]
        for rid in suspects:
            req = self.s.requests.get(rid)
            if req is None or req.is_finished() or rng.random() > 0.15:
                continue
            if req.status == WAITING_FOR_REMOTE_KVS and rng.random() < 0.5:
                out.failed_recving.add(rid)
            else:
                out.invalid_block_ids.add(rng.choice(table(self.s, req)))
        return out


def bad_block(s: Scheduler, req: Request, index: int) -> Callable[..., KVConnectorOutput]:
    """Reports block ``index`` of ``req``'s table as bad in the step it is given to."""
    return lambda so: KVConnectorOutput(invalid_block_ids={table(s, req)[index]})
