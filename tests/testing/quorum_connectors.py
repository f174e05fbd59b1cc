"""Scripted connectors for the kit's multi-worker quorum scenario on a tensor-parallel engine.

:class:`RankZeroFreeConnector` keeps every request's blocks (a delayed free, as
``DelayedFreeConnector``) but only rank 0's worker reports the free in ``finished_sending``.
``kv_connector_extra_config``: ``finished_count`` (default None): what
``get_finished_count()`` answers. With 1 the connector is right (one report is the quorum);
with None the executor waits for every rank, so the free never completes and the blocks are
held forever. ``report_twice``: rank 0 reports each free twice (two steps in a row), the
other ranks never: with None as the count, the two reports of one rank would make a quorum
of two.
"""

from __future__ import annotations

from typing import Any

from kvferry.model.parallel import tp_rank
from tests.helpers.conformance_connectors import DelayedFreeConnector


class RankZeroFreeConnector(DelayedFreeConnector):
    subclass_options = (*DelayedFreeConnector.subclass_options, "finished_count", "report_twice")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        count = extra.get("finished_count")
        self.finished_count = None if count is None else int(count)
        self.report_twice = bool(extra.get("report_twice", False))
        self._again: set[str] = set()

    def get_finished_count(self) -> int | None:
        return self.finished_count

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        if tp_rank() != 0:
            return None, recving
        if self.report_twice:
            again, self._again = self._again, set(sending or ())
            sending = (sending or set()) | again or None
        return sending, recving
