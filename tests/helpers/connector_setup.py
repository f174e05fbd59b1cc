"""A scheduler wired to a :class:`~tests.helpers.scripted_connector.ScriptedConnector` and a
stateful :class:`~tests.helpers.scheduler.FakeWorker`, for the scheduler-connector tests.
"""

from __future__ import annotations

from typing import Any

from kvferry.core.scheduler import Scheduler
from kvferry.request import RequestStatus
from tests.helpers.scheduler import FakeWorker, create_scheduler
from tests.helpers.scripted_connector import ScriptedConnector

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


def setup(policy: str = "fail", **kwargs: Any) -> tuple[Scheduler, ScriptedConnector, FakeWorker]:
    conn = ScriptedConnector()
    s = create_scheduler(connector=conn, kv_load_failure_policy=policy, **kwargs)
    return s, conn, FakeWorker(s)
