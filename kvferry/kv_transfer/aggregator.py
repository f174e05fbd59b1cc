"""KVOutputAggregator: combines the workers' KVConnectorOutputs of one step into one.

A request id is reported finished (sending or receiving) only once every expected worker has
reported it, possibly over several steps. A failed receive is reported when its
finished_recving quorum completes, so the scheduler sees failure and completion together.
KV cache events are merged per step (``merge_worker_events``): an event is published once
every worker of the step reported it, unless the connector's ``KVConnectorKVEvents`` keeps
more (the union, for sharded writes).
"""

from __future__ import annotations

from collections import defaultdict

from kvferry.kv_events.aggregation import merge_worker_events
from kvferry.step_types.kv_connector_output import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, expected_finished_count: int) -> None:
        if expected_finished_count <= 0:
            raise ValueError("expected_finished_count must be positive")
        self.expected = expected_finished_count
        self._remaining_send: dict[str, int] = {}
        self._remaining_recv: dict[str, int] = {}
        self._pending_failed: set[str] = set()

    def _vote(self, remaining: dict[str, int], req_ids: set[str] | None, done: set[str]) -> None:
        for req_id in req_ids or ():
            left = remaining.get(req_id, self.expected) - 1
            if left <= 0:
                remaining.pop(req_id, None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        sending: set[str] = set()
        recving: set[str] = set()
        result = KVConnectorOutput()
        for out in outputs:
            if out is None:
                continue
            if out.expected_finished_count > 0:
                self.expected = out.expected_finished_count
            self._vote(self._remaining_send, out.finished_sending, sending)
            self._vote(self._remaining_recv, out.finished_recving, recving)
            if out.kv_connector_stats is not None:
                if result.kv_connector_stats is None:
                    result.kv_connector_stats = out.kv_connector_stats
                else:
                    result.kv_connector_stats.aggregate(out.kv_connector_stats)
            if out.kv_connector_worker_meta is not None:
                if result.kv_connector_worker_meta is None:
                    result.kv_connector_worker_meta = out.kv_connector_worker_meta
                else:
                    result.kv_connector_worker_meta = result.kv_connector_worker_meta.aggregate(
                        out.kv_connector_worker_meta
                    )
            result.invalid_block_ids |= out.invalid_block_ids
            self._pending_failed |= out.failed_recving
        result.kv_cache_events = merge_worker_events(
            [out.kv_cache_events if out is not None else None for out in outputs]
        )
        failed = self._pending_failed & recving
        self._pending_failed -= failed
        result.finished_sending = sending or None
        result.finished_recving = recving or None
        result.failed_recving = failed
        result.expected_finished_count = self.expected
        return result

    def pending(self) -> dict[str, dict[str, int]]:
        """Votes still missing per request (for debugging and leak checks)."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for req_id, n in self._remaining_send.items():
            out[req_id]["sending"] = n
        for req_id, n in self._remaining_recv.items():
            out[req_id]["recving"] = n
        return dict(out)
