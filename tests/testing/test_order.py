"""The conformance kit's call-order check on hand-written traces."""

from __future__ import annotations

from typing import Any

from kvferry.testing.order import check_order

LAYERS = ["wait_for_layer_load", "save_kv_layer"] * 2


def _w(*methods: str) -> list[dict[str, Any]]:
    return [{"role": "worker", "method": m} for m in methods]


def _s(method: str, *req_ids: str) -> dict[str, Any]:
    return {"role": "scheduler", "method": method, "req_ids": list(req_ids)}


def _step(
    *, load_after_layers: bool = False, post: tuple[str, ...] = ("get_transfer_results",)
) -> list[dict[str, Any]]:
    pre = ["handle_preemptions", "bind_connector_metadata"]
    middle = [*LAYERS, "start_load_kv"] if load_after_layers else ["start_load_kv", *LAYERS]
    return [_s("build_connector_meta"), *_w(*pre, *middle, "finish_forward", "wait_for_save", *post,
            "get_block_ids_with_load_errors", "clear_connector_metadata")]  # fmt: skip


def _run(*steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    setup = _w("register_kv_caches", "set_host_xfer_buffer_ops")
    return setup + [r for s in steps for r in s] + _w("shutdown")


def test_vllm_order_passes_with_either_results_hook() -> None:
    assert check_order(_run(_step(), _step(post=("get_finished", "get_failed_recving")))) == []
    assert check_order(_run(_step(post=("get_transfer_results", "get_finished")))) == []


def test_start_load_kv_after_the_layers_is_reported() -> None:
    problems = check_order(_run(_step(), _step(load_after_layers=True)))
    assert len(problems) == 1
    assert "start_load_kv ran after the attention layers" in problems[0]
    assert "worker step 2; 1 of 2 steps" in problems[0]


def test_missing_or_misplaced_step_calls_are_reported() -> None:
    no_preempt = [r for r in _step() if r["method"] != "handle_preemptions"]
    assert any("outside a step" in p for p in check_order(_run(no_preempt)))
    late_finish = [r for r in _step() if r["method"] != "finish_forward"]
    late_finish.insert(-2, {"role": "worker", "method": "finish_forward"})
    assert any("finish_forward not between" in p for p in check_order(_run(late_finish)))
    unbuilt = [r for r in _step() if r["method"] != "build_connector_meta"]
    assert any("without a build_connector_meta" in p for p in check_order(_run(unbuilt)))


def test_request_rules() -> None:
    records = [_s("update_state_after_alloc", "a"), _s("get_num_new_matched_tokens", "b"),
               _s("request_finished", "b"), _s("request_finished", "b"),
               _s("get_num_new_matched_tokens", "b")]  # fmt: skip
    problems = check_order(records)
    assert "update_state_after_alloc for a without a lookup before it" in problems
    assert "request_finished called twice for b" in problems
    assert "get_num_new_matched_tokens for request b after its request_finished" in problems
