"""The NixlConnector's scheduler side driven by the real Scheduler (no workers, no NIXL):
holds and params on the prefill side, reads planned once on the decode side, invalid params
failing the load under either policy, and releases of never-admitted requests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.pd.metadata import PDWorkerMeta as NixlWorkerMeta
from kvferry.kv_transfer.connectors.pd.params import token_digest
from kvferry.request import RequestStatus
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_kv_cache_config,
    step,
)

GOOD = {
    "do_remote_prefill": True,
    "remote_engine_id": "eng-P",
    "remote_request_id": "p-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "remote_block_ids": [7, 8, 9],
    "remote_num_tokens": 40,
    "tp_size": 1,
}


def _connector(port: int = 5555, **extra: Any) -> NixlConnector:
    kvt = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        engine_id="eng-P",
        kv_connector_extra_config={"side_channel_port": port, **extra},
    )
    config = SimpleNamespace(kv_transfer_config=kvt)
    return NixlConnector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config(64))  # type: ignore[arg-type]


def _request(params: Any, n: int = 40, max_tokens: int = 1, **kw: Any):
    req = create_request(n, max_tokens=max_tokens, ignore_eos=True, **kw)
    req.kv_transfer_params = params
    return req


def test_options_are_typed():
    with pytest.raises(ConfigError, match="unknown"):
        _connector(lease=3)
    with pytest.raises(ConfigError, match="kv_lease_duration"):
        _connector(kv_lease_duration=-1)
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        _connector(kv_lease_duration=3, heartbeat_interval=5)


def test_prefill_side_holds_blocks_and_returns_params():
    conn = _connector(port=0)
    sched = create_scheduler(connector=conn)
    req = _request({"do_remote_decode": True})
    sched.add_request(req)
    # Port 0: the request waits until the workers report the side channel's address.
    address = NixlWorkerMeta({0: ("10.0.0.2", 4242)})
    so, outs = step(sched, kv_output=KVConnectorOutput(kv_connector_worker_meta=address))
    assert so.total_num_scheduled_tokens == 0 and not outs
    so, outs = step(sched)
    params = outs[0].kv_transfer_params
    assert outs[0].finished and params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "eng-P",
        "remote_request_id": req.request_id,
        "remote_host": "10.0.0.2",
        "remote_port": 4242,
        "remote_block_ids": so.scheduled_new_reqs[0].block_ids[0],
        "remote_num_tokens": 40,
        "tp_size": 1,
        "remote_prefill_cached_tokens": 0,
    }
    assert so.kv_connector_metadata.expected_sends == [req.request_id]
    so, _ = step(sched)
    (send,) = so.kv_connector_metadata.reqs_to_send
    assert send.block_ids == params["remote_block_ids"] and send.num_tokens == 40
    assert sched.kv_cache_manager.get_num_free_blocks() < 64  # held for the reader
    step(sched, kv_output=KVConnectorOutput(finished_sending={req.request_id}))
    assert_no_leaks(sched)


def test_aborted_prefill_holds_nothing():
    sched = create_scheduler(connector=_connector())
    req = _request({"do_remote_decode": True}, max_tokens=4)
    sched.add_request(req)
    step(sched)
    (out,) = sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert out.kv_transfer_params is None
    so, _ = step(sched)
    assert not so.kv_connector_metadata.reqs_to_send
    assert_no_leaks(sched)


def test_decode_side_reads_once_into_the_new_blocks():
    sched = create_scheduler(connector=_connector())
    shared = {**GOOD}
    req = _request(shared, max_tokens=3)
    sched.add_request(req)
    so, _ = step(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = so.kv_connector_metadata.reqs_to_recv
    assert spec.remote is not None and spec.remote.request_id == "p-1"
    assert spec.remote_block_ids == [7, 8, 9] and spec.first_block == 0
    assert spec.local_block_ids == sched.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert spec.token_digest == token_digest(req.prompt_token_ids, 40)
    # One-shot: the request's params say so now; the caller's dict is untouched.
    assert req.kv_transfer_params["do_remote_prefill"] is False and shared["do_remote_prefill"]
    step(sched, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {req.request_id: 1}  # full hit: recompute the last one
    while sched.has_requests():
        so, _ = step(sched)
        assert not so.kv_connector_metadata.reqs_to_recv
    assert_no_leaks(sched)


def test_decode_with_local_hit_reads_the_tail_and_heartbeats_while_waiting():
    conn = _connector(heartbeat_interval=0.01)
    sched = create_scheduler(connector=conn)
    prompt = list(range(500, 540))
    sched.add_request(_request(None, prompt_token_ids=prompt[:33]))
    while sched.has_requests():
        step(sched)
    req = _request({**GOOD}, prompt_token_ids=prompt)
    assert conn.get_num_new_matched_tokens(req, 32) == (8, True)
    meta = conn.build_connector_meta(None)  # type: ignore[arg-type]
    assert [r.request_id for r in meta.heartbeats] == ["p-1"]
    sched.add_request(req)
    so, _ = step(sched)
    (spec,) = so.kv_connector_metadata.reqs_to_recv
    assert spec.first_block == 2 and len(spec.local_block_ids) == 1
    assert spec.local_block_ids == sched.kv_cache_manager.get_block_ids(req.request_id)[0][2:]
    step(sched, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    while sched.has_requests():
        step(sched)
    assert_no_leaks(sched)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_invalid_decode_params_fail_the_load_and_hold_nothing(policy):
    sched = create_scheduler(connector=_connector(), kv_load_failure_policy=policy)
    req = _request({**GOOD, "remote_block_ids": [7, 8]}, max_tokens=2)
    sched.add_request(req)
    so, _ = step(sched)
    (spec,) = so.kv_connector_metadata.reqs_to_recv
    assert spec.remote is None and "needs 3 blocks" in (spec.error or "")
    failed = KVConnectorOutput(finished_recving={req.request_id}, failed_recving={req.request_id})
    _, outs = step(sched, kv_output=failed)
    if policy == "fail":
        assert outs[0].finish_reason == "error"
    while sched.has_requests():
        so, _ = step(sched)
        assert not so.kv_connector_metadata.reqs_to_recv  # never a second attempt
    assert req.status == (
        RequestStatus.FINISHED_ERROR if policy == "fail" else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert_no_leaks(sched)


def test_unadmitted_decode_request_releases_the_prefill_blocks():
    sched = create_scheduler(connector=_connector())
    req = _request({**GOOD})
    sched.add_request(req)
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    # The server's release path: P's own params on a one-token request aborted at once.
    dummy = _request({**GOOD, "remote_request_id": "p-2"}, n=1)
    sched.add_request(dummy)
    sched.finish_requests(dummy.request_id, RequestStatus.FINISHED_ABORTED)
    assert sched.has_requests()
    so, _ = step(sched)
    releases = so.kv_connector_metadata.releases
    assert [(r.remote.request_id, r.block_ids) for r in releases] == [
        ("p-1", [7, 8, 9]),
        ("p-2", [7, 8, 9]),
    ]
    # Neither held blocks: each ends once the workers report its release answered.
    assert [r.req_id for r in releases] == [req.request_id, dummy.request_id]
    assert sched.has_requests() and len(sched.requests) == 2
    step(sched, kv_output=KVConnectorOutput(finished_sending={req.request_id, dummy.request_id}))
    assert_no_leaks(sched)
