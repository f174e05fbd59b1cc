"""MultiConnector's worker events: the union of its children's, whatever container they use."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvferry.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from kvferry.kv_events.aggregation import CommonKVEvents
from kvferry.kv_transfer.connectors.multi_connector import MultiConnector


def _child(events: Any) -> SimpleNamespace:
    return SimpleNamespace(get_kv_connector_kv_cache_events=lambda: events)


def test_children_events_are_flattened_from_lists_and_event_objects() -> None:
    stored = BlockStored([1], None, [3] * 16, 16, None, MEDIUM_CPU, None)
    removed = BlockRemoved([2], MEDIUM_STORAGE)
    obj = CommonKVEvents(num_workers=1)
    obj.add_events([removed])
    fake = SimpleNamespace(children=[_child([stored]), _child(None), _child(obj)])
    assert MultiConnector.get_kv_connector_kv_cache_events(fake) == [stored, removed]  # type: ignore[arg-type]
    empty = SimpleNamespace(children=[_child(None), _child([])])
    assert MultiConnector.get_kv_connector_kv_cache_events(empty) is None  # type: ignore[arg-type]
