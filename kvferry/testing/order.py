"""The call-order check: a recorded protocol trace against the order the protocol documents
(``kvferry.kv_transfer.base``), which is vLLM's.

Per step on the worker side: ``handle_preemptions -> bind_connector_metadata ->
start_load_kv -> per-layer wait_for_layer_load / save_kv_layer -> (finish_forward) ->
wait_for_save -> get_transfer_results or get_finished -> (load errors, worker metadata) ->
clear_connector_metadata``, with ``start_load_kv`` before the first attention layer on every
step that carries metadata (vLLM's order; a run that calls it after the layers fails). The
scheduler side builds each step's metadata before the workers bind it and consumes the
workers' output only between steps. Per request: a lookup before the allocation callback,
``request_finished`` at most once and nothing for the request after it.
"""

from __future__ import annotations

from typing import Any

LAYER = ("wait_for_layer_load", "save_kv_layer")
# The step's fixed sequence on the worker side; the per-layer hooks sit between the 3rd and
# the 4th. Calls not named here (load errors, worker metadata) may come after get_finished.
STEP_SEQUENCE = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
)
AFTER_GET_FINISHED = ("get_block_ids_with_load_errors", "get_failed_recving",
                      "build_connector_worker_meta")  # fmt: skip
SETUP = ("register_kv_caches", "set_host_xfer_buffer_ops")
REQUEST_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc")
FINISH = ("request_finished", "request_finished_all_groups")

EXPECTED = (
    "handle_preemptions -> bind_connector_metadata -> start_load_kv -> layers -> "
    "(finish_forward) -> wait_for_save -> get_transfer_results -> clear_connector_metadata"
)


def _worker_steps(records: list[dict[str, Any]]) -> tuple[list[list[str]], list[str]]:
    """The worker's calls cut into steps (each ending at clear_connector_metadata), and
    violations found while cutting (calls outside any step, set-up out of place)."""
    steps: list[list[str]] = []
    current: list[str] = []
    problems: list[str] = []
    seen_step = False
    for rec in records:
        if rec.get("role") != "worker":
            continue
        m = rec["method"]
        if m in SETUP:
            if seen_step:
                problems.append(f"{m} after the first step (set-up must precede every step)")
            continue
        if m == "shutdown":
            if current:
                problems.append("shutdown inside a step (before clear_connector_metadata)")
            continue
        if not current and m != "handle_preemptions":
            problems.append(f"{m} outside a step (a step starts with handle_preemptions)")
            continue
        seen_step = True
        current.append(m)
        if m == "clear_connector_metadata":
            steps.append(current)
            current = []
    if current:
        steps.append(current)
    return steps, problems


def _normalize(calls: list[str]) -> list[str]:
    """``get_transfer_results`` stands for ``get_finished`` (0.33's name; its default calls
    the 0.20.2 pair, which then appear right after it)."""
    if "get_transfer_results" not in calls:
        return calls
    return [("get_finished" if m == "get_transfer_results" else m) for m in calls
            if m not in ("get_finished", "get_failed_recving")]  # fmt: skip


def _check_step(raw: list[str]) -> str | None:
    """The first way one worker step departs from :data:`STEP_SEQUENCE`, or None."""
    calls = _normalize(raw)
    if calls.count("finish_forward") > 1:
        return "finish_forward called more than once in a step"
    if "finish_forward" in calls:
        at = calls.index("finish_forward")
        if any(m in LAYER for m in calls[at:]) or "wait_for_save" in calls[:at]:
            return f"finish_forward not between the layers and wait_for_save ({_short(raw)})"
        calls = calls[:at] + calls[at + 1 :]
    fixed = [m for m in calls if m not in LAYER and m not in AFTER_GET_FINISHED]
    if fixed != list(STEP_SEQUENCE):
        return f"calls {_short(raw)}, expected {EXPECTED}"
    start, wait = calls.index("start_load_kv"), calls.index("wait_for_save")
    layers = [i for i, m in enumerate(calls) if m in LAYER]
    if layers and start > layers[0]:
        return (
            "start_load_kv ran after the attention layers, vLLM calls it before the forward "
            f"({_short(raw)})"
        )
    if layers and layers[-1] > wait:
        return f"per-layer hooks outside start_load_kv .. wait_for_save: {_short(raw)}"
    finished = calls.index("get_finished")
    late = [m for m in calls[:finished] if m in AFTER_GET_FINISHED]
    if late:
        return f"{late[0]} before get_finished"
    return None


def _short(calls: list[str]) -> str:
    out: list[str] = []
    for m in calls:
        name = "layers" if m in LAYER else m
        if not out or out[-1] != name:
            out.append(name)
    return " -> ".join(out)


def _check_roles(records: list[dict[str, Any]]) -> list[str]:
    """Scheduler vs worker: every bind follows a build_connector_meta of its own step, and
    update_connector_output never lands inside a worker step."""
    problems: list[str] = []
    built = 0
    in_step = False
    for rec in records:
        m, role = rec["method"], rec.get("role")
        if role == "scheduler" and m == "build_connector_meta":
            built += 1
        elif role == "scheduler" and m == "update_connector_output" and in_step:
            problems.append("update_connector_output while a worker step was in progress")
        elif role == "worker" and m == "bind_connector_metadata":
            if built < 1:
                problems.append("bind_connector_metadata without a build_connector_meta before it")
            built = 0
            in_step = True
        elif role == "worker" and m == "clear_connector_metadata":
            in_step = False
    return problems


def _check_requests(records: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    looked_up: set[str] = set()
    finished: set[str] = set()
    for rec in records:
        if rec.get("role") != "scheduler":
            continue
        m = rec["method"]
        for rid in rec.get("req_ids", []):
            if m in REQUEST_HOOKS and rid in finished:
                problems.append(f"{m} for request {rid} after its request_finished")
            if m == "get_num_new_matched_tokens":
                looked_up.add(rid)
            elif m == "update_state_after_alloc" and rid not in looked_up:
                problems.append(f"update_state_after_alloc for {rid} without a lookup before it")
            elif m in FINISH:
                if rid in finished:
                    problems.append(f"request_finished called twice for {rid}")
                finished.add(rid)
    return problems


def check_order(records: list[dict[str, Any]], limit: int = 5) -> list[str]:
    """Violations of the documented call order in a trace's records (empty: in order). Steps
    that break the same rule are reported once, with how many did."""
    steps, problems = _worker_steps(records)
    by_rule: dict[str, list[int]] = {}
    for n, calls in enumerate(steps, 1):
        rule = _check_step(calls)
        if rule is not None:
            by_rule.setdefault(rule, []).append(n)
    for rule, numbers in by_rule.items():
        where = ", ".join(map(str, numbers[:4])) + (", ..." if len(numbers) > 4 else "")
        problems.append(f"{rule} (worker step {where}; {len(numbers)} of {len(steps)} steps)")
    problems += _check_roles(records) + _check_requests(records)
    return list(dict.fromkeys(problems))[:limit]
