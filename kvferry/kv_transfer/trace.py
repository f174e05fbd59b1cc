"""Connector protocol trace: record every connector call of a real run, render it as mermaid.

``TracingConnector`` wraps the connector the factory built (when ``KVFERRY_TRACE_CONNECTOR=1``)
and appends one JSON line per call to a file: time, role, method, request ids, and a short
summary of arguments and result. ``render_mermaid`` turns such a file into the sequence diagram
of the seed document (``kvferry trace FILE``), collapsing per-layer hook calls.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorRole

SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)
WORKER_METHODS = (
    "register_kv_caches",
    "set_host_xfer_buffer_ops",
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_failed_recving",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "shutdown",
)
LAYER_METHODS = ("wait_for_layer_load", "save_kv_layer")


def _req_ids(value: Any) -> list[str]:
    from kvferry.core.sched_output import SchedulerOutput
    from kvferry.kv_transfer.output import KVConnectorOutput
    from kvferry.request import Request

    if isinstance(value, Request):
        return [value.request_id]
    if isinstance(value, SchedulerOutput):
        return sorted(value.num_scheduled_tokens)
    if isinstance(value, KVConnectorOutput):
        return sorted((value.finished_sending or set()) | (value.finished_recving or set()))
    if isinstance(value, (set, frozenset)) and all(isinstance(v, str) for v in value):
        return sorted(value)
    return []


def _summary(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return [_summary(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))[:8]
    if isinstance(value, dict):
        return {str(k): _summary(v) for k, v in list(value.items())[:8]}
    return type(value).__name__


class TraceWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()


class TracingConnector:
    """Forwards every attribute to the wrapped connector and records protocol calls."""

    def __init__(self, inner: KVConnectorBase, writer: TraceWriter) -> None:
        self._inner = inner
        self._writer = writer
        self._role = "scheduler" if inner.role == KVConnectorRole.SCHEDULER else "worker"

    @property
    def inner(self) -> KVConnectorBase:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in SCHEDULER_METHODS and name not in WORKER_METHODS:
            return attr

        def traced(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            req_ids = sorted({r for a in args for r in _req_ids(a)} | set(_req_ids(result)))
            record: dict[str, Any] = {
                "t": time.time(),
                "role": self._role,
                "method": name,
                "req_ids": req_ids,
            }
            if name in LAYER_METHODS and args:
                record["layer"] = args[0]
            elif name in ("get_num_new_matched_tokens", "request_finished", "get_finished"):
                record["result"] = _summary(result)
            elif name == "update_state_after_alloc" and len(args) >= 3:
                record["num_external_tokens"] = args[2]
            self._writer.write(record)
            return result

        return traced


def maybe_wrap(connector: KVConnectorBase) -> KVConnectorBase:
    from kvferry import envs

    if not envs.trace_connector():
        return connector
    return TracingConnector(connector, TraceWriter(envs.trace_connector_file()))  # type: ignore[return-value]


_ARROWS = {
    "get_num_new_matched_tokens": ("S", "C"),
    "update_state_after_alloc": ("S", "C"),
    "build_connector_meta": ("S", "C"),
    "update_connector_output": ("S", "C"),
    "request_finished": ("S", "C"),
    "request_finished_all_groups": ("S", "C"),
    "wait_for_layer_load": ("A", "W"),
    "save_kv_layer": ("A", "W"),
}


def render_mermaid(path: str | Path, max_steps: int | None = None) -> str:
    """A mermaid ``sequenceDiagram`` of a trace file; per-layer hooks are collapsed."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lines = [
        "sequenceDiagram",
        "    participant S as Scheduler",
        "    participant C as Scheduler-side connector",
        "    participant W as Worker-side connector",
        "    participant A as Attention layers",
    ]
    steps = 0
    i = 0
    while i < len(records):
        rec = records[i]
        method = rec["method"]
        n = 1
        if method in LAYER_METHODS:
            while (
                i + n < len(records)
                and records[i + n]["method"] in LAYER_METHODS
                and records[i + n]["role"] == rec["role"]
            ):
                n += 1
        if method == "build_connector_meta":
            steps += 1
            if max_steps is not None and steps > max_steps:
                lines.append("    Note over S,A: ... trace truncated ...")
                break
            lines.append(f"    Note over S,A: step {steps}")
        src, dst = _ARROWS.get(method, ("W", "W"))
        reqs = ",".join(rec.get("req_ids", [])[:4])
        if method in LAYER_METHODS:
            label = f"wait_for_layer_load / save_kv_layer x{n}"
        else:
            label = f"{method}({reqs})"
            if method == "update_state_after_alloc":
                label = f"{method}({reqs}, ext={rec.get('num_external_tokens')})"
        lines.append(f"    {src}->>{dst}: {label}")
        if "result" in rec and method == "get_num_new_matched_tokens":
            lines.append(f"    {dst}-->>{src}: {rec['result']}")
        elif "result" in rec and rec["result"] not in (None, [None, None], [False, None]):
            lines.append(f"    {dst}-->>{src}: {json.dumps(rec['result'])}")
        i += n
    return "\n".join(lines) + "\n"
