"""Connector protocol trace: record every connector call of a real run, render it as mermaid.

``TracingConnector`` wraps the connector the factory built (when ``KVFERRY_TRACE_CONNECTOR=1``)
and appends one JSON line per call to a file: time, role, method, request ids, a short summary
of arguments and result, and the id of the run. A run is one engine (its scheduler and
worker sides) and starts with a ``run_start`` marker; a process's first run starts the file
anew unless ``KVFERRY_TRACE_APPEND=1``, later engines of the same process add their runs.
``render_mermaid`` turns each run of such a file into the sequence diagram of the seed
document (``kvferry trace FILE``), collapsing per-layer hook calls.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorRole, KVConnectorTransferResults

SCHEDULER_METHODS = (
    "bind_kv_cache_manager",
    "set_xfer_handshake_metadata_pp_aware",
    "set_xfer_handshake_metadata",
    "on_new_request",
    "get_num_new_matched_tokens",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
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
    "finish_forward",
    "wait_for_save",
    "get_transfer_results",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_failed_recving",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "shutdown",
)
LAYER_METHODS = ("wait_for_layer_load", "save_kv_layer")


def _req_ids(value: Any) -> list[str]:
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

    if isinstance(value, Request):
        return [value.request_id]
    if isinstance(value, SchedulerOutput):
        return sorted(value.num_scheduled_tokens)
    if isinstance(value, KVConnectorTransferResults):
        return sorted(value.finished_sending | value.finished_recving)
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
        return {str(getattr(k, "value", k)): _summary(v) for k, v in list(value.items())[:8]}
    return type(value).__name__


RUN_MARKER = "run_start"


class TraceWriter:
    """Writes one run's records to ``path``; truncates it first unless ``append``. Opened in
    append mode either way, so processes sharing a file never overwrite each other's lines."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fh = os.fdopen(os.open(self.path, flags, 0o644), "a", encoding="utf-8")
        self.write({"t": time.time(), "role": "run", "method": RUN_MARKER, "pid": os.getpid()})

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._fh.write(json.dumps({**record, "run": self.run_id}) + "\n")
            self._fh.flush()


# Per file, the runs of this process: (engine config, its writer).
_RUNS: dict[Path, list[tuple[weakref.ref[Any], TraceWriter]]] = {}
_RUNS_LOCK = threading.Lock()


def run_writer(path: str | Path, engine: Any) -> TraceWriter:
    """The writer of ``engine``'s run (any object standing for one engine, e.g. its
    ``EngineConfig``) in ``path``: created by the first of its connectors, shared by the rest."""
    from kvferry import envs

    key = Path(path).resolve()
    with _RUNS_LOCK:
        # Identity, not equality: two engines with equal configs are two runs.
        runs = [(ref, w) for ref, w in _RUNS.get(key, []) if ref() is not None]
        for ref, writer in runs:
            if ref() is engine:
                return writer
        # Truncating under another engine of this process would lose its run.
        writer = TraceWriter(key, append=envs.trace_append() or key in _RUNS)
        _RUNS[key] = [*runs, (weakref.ref(engine), writer)]
        return writer


class TracingConnector:
    """Forwards every attribute to the wrapped connector and records protocol calls."""

    def __init__(self, inner: KVConnectorBase, writer: TraceWriter) -> None:
        self._inner = inner
        self._writer = writer
        self._role = "scheduler" if inner.role == KVConnectorRole.SCHEDULER else "worker"

    @property
    def inner(self) -> KVConnectorBase:
        return self._inner

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if type(self._inner).get_transfer_results is KVConnectorBase.get_transfer_results:
            # The default composes get_finished and get_failed_recving: record those calls.
            return KVConnectorBase.get_transfer_results(self, finished_req_ids)  # type: ignore[arg-type]
        return self.__getattr__("get_transfer_results")(finished_req_ids)

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
            elif name in (
                "get_num_new_matched_tokens",
                "request_finished",
                "get_finished",
                "get_external_cache_hit_sources",
            ):
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
    config = getattr(connector, "_config", connector)
    # A vLLM-style connector holds a VllmConfig view per role: its engine is the config under it.
    writer = run_writer(envs.trace_connector_file(), getattr(config, "engine_config", config))
    return TracingConnector(connector, writer)  # type: ignore[return-value]


_ARROWS = {
    "on_new_request": ("S", "C"),
    "get_num_new_matched_tokens": ("S", "C"),
    "get_loaded_kv_cache_group_ids": ("S", "C"),
    "get_external_cache_hit_sources": ("S", "C"),
    "update_state_after_alloc": ("S", "C"),
    "build_connector_meta": ("S", "C"),
    "update_connector_output": ("S", "C"),
    "request_finished": ("S", "C"),
    "request_finished_all_groups": ("S", "C"),
    "wait_for_layer_load": ("A", "W"),
    "save_kv_layer": ("A", "W"),
}


@dataclass
class TraceRun:
    """One run of a trace file: its ``run_start`` marker (None in files written before runs
    were marked) and its records in file order."""

    marker: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)

    def title(self) -> str:
        if self.marker is None:
            return "unmarked run"
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.marker.get("t", 0)))
        return f"pid {self.marker.get('pid')}, started {started}"


def read_runs(path: str | Path) -> list[TraceRun]:
    """The runs of a trace file, in order of their start. Records are grouped by their run id,
    so runs that appended to one file at the same time come apart again; ValueError if a line
    is not a trace record."""
    runs: dict[str | None, TraceRun] = {}
    current: str | None = None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict) or not isinstance(rec.get("method"), str):
            raise ValueError(f"line {n} is not a trace record")
        if rec["method"] == RUN_MARKER:
            current = rec.get("run") or f"line {n}"
            runs[current] = TraceRun(rec)
            continue
        key = rec.get("run", current)
        runs.setdefault(key, TraceRun(None)).records.append(rec)
    return list(runs.values())


def render_mermaid(path: str | Path, max_steps: int | None = None, run: int | None = None) -> str:
    """Mermaid for a trace file: run number ``run`` (1-based; negative counts from the end) as
    one bare ``sequenceDiagram``; without ``run``, the same for a file holding one run, and a
    Markdown document with one diagram per run for a file holding several."""
    runs = read_runs(path)
    if run is not None:
        if not (1 <= run <= len(runs) or -len(runs) <= run <= -1):
            raise IndexError(f"the trace holds {len(runs)} run(s), so there is no run {run}")
        return render_run(runs[run - 1 if run > 0 else run].records, max_steps)
    if len(runs) <= 1:
        return render_run(runs[0].records if runs else [], max_steps)
    parts = []
    for i, r in enumerate(runs, 1):
        diagram = render_run(r.records, max_steps)
        parts.append(f"## run {i} of {len(runs)} ({r.title()})\n\n```mermaid\n{diagram}```\n")
    return "\n".join(parts)


def render_run(records: list[dict[str, Any]], max_steps: int | None = None) -> str:
    """A mermaid ``sequenceDiagram`` of one run's records; per-layer hooks are collapsed."""
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
