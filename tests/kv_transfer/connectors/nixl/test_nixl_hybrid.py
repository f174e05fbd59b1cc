"""The NixlConnector on a hybrid engine (full attention + a sliding window), scheduler side
driven by the real Scheduler: the prefill side advertises one block list per KV cache group
(the sliding group only the blocks in the window of the last prompt token, never the null
block), the decode side reads every group's blocks into its own, and malformed per-group
params fail only their own request's load."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from kvferry.config import KVTransferConfig
from kvferry.kv_transfer.base import KVConnectorRole, supports_hma
from kvferry.kv_transfer.connectors.nixl.connector import NixlConnector
from kvferry.kv_transfer.connectors.pd.auth import NotAuthenticated, ParamsSigner
from kvferry.kv_transfer.connectors.pd.params import (
    ParamsError,
    check_signature,
    decode_params,
    parse_remote,
)
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from tests.helpers.scheduler import (
    assert_no_leaks,
    create_request,
    create_scheduler,
    make_kv_cache_config,
    step,
)
from tests.kv_transfer.connectors.nixl.test_nixl_scheduler import GOOD as ONE_GROUP

WINDOW = 20  # tokens; blocks of 16 (tests.helpers.scheduler.BLOCK_SIZE)
BS = 16


def _connector(engine_id: str) -> NixlConnector:
    kvt = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={"side_channel_port": 5555},
    )
    config = SimpleNamespace(kv_transfer_config=kvt)
    kv = make_kv_cache_config(64, sliding_window=WINDOW)
    return NixlConnector(config, KVConnectorRole.SCHEDULER, kv)  # type: ignore[arg-type]


def _sched(engine_id: str, **kw: Any):
    return create_scheduler(connector=_connector(engine_id), sliding_window=WINDOW, **kw)


def _prefill(prompt: list[int]) -> tuple[dict[str, Any], tuple[list[int], ...]]:
    """Run a prefill request to its end; its params and its per-group tables at the end."""
    sched = _sched("eng-P", max_num_batched_tokens=32)  # chunked: the window moves
    req = create_request(len(prompt), max_tokens=1, prompt_token_ids=prompt)
    req.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(req)
    tables = None
    params = None
    while params is None:
        tables = sched.kv_cache_manager.get_block_ids(req.request_id) or tables
        _, outs = step(sched)
        if outs and outs[0].finished:
            params = outs[0].kv_transfer_params
    tables = sched.kv_cache_manager.get_block_ids(req.request_id)
    step(sched, kv_output=KVConnectorOutput(finished_sending={req.request_id}))
    assert_no_leaks(sched)
    return params, tables


def test_nixl_connector_supports_hma():
    assert supports_hma(NixlConnector)


@pytest.mark.parametrize("n", [7, 21, 40, 100])
def test_prefill_advertises_each_group_and_only_the_window(n):
    prompt = list(range(300, 300 + n))
    params, (full, sliding) = _prefill(prompt)
    nb = -(-n // BS)
    first = max(0, n - WINDOW) // BS
    assert params["remote_block_ids"] == [full[:nb], sliding[first:nb]]
    assert 0 not in params["remote_block_ids"][1]  # the null block never travels
    # What the prefill side advertises is what a decode instance accepts.
    remote = parse_remote(params, BS, windows=(None, WINDOW))
    assert remote.group_sizes() == (nb, nb - first)


# 99: the window of the recomputed last token (position 98) starts in block 4, the one of
# position 99 in block 5: the decode side must hold (and read) block 4.
@pytest.mark.parametrize("n", [99, 100])
def test_decode_reads_every_group_into_its_own_blocks(n):
    prompt = list(range(300, 300 + n))
    params, _ = _prefill(prompt)
    full_remote, sliding_remote = params["remote_block_ids"]
    sched = _sched("eng-D")
    req = create_request(n, max_tokens=3, prompt_token_ids=prompt)
    req.kv_transfer_params = {**params}
    sched.add_request(req)
    so, _ = step(sched)
    (spec,) = so.kv_connector_metadata.reqs_to_recv
    full, sliding = sched.kv_cache_manager.get_block_ids(req.request_id)
    nb, first = -(-n // BS), (n - WINDOW) // BS
    # Out-of-window blocks are null locally: nothing is read into them.
    assert sliding[:first] == [0] * first and 0 not in sliding[first:nb]
    assert spec.local_block_ids == full[:nb] + sliding[first:nb]
    assert spec.read_block_ids == full_remote + sliding_remote
    assert spec.remote_block_ids == full_remote + sliding_remote  # the claim names them all
    step(sched, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {req.request_id: 1}  # recompute the last prompt token
    while sched.has_requests():
        step(sched)
    assert_no_leaks(sched)


# 40 tokens: blocks 0-2 in the full group; a window of 20 from block 1 on.
GOOD = {**ONE_GROUP, "remote_block_ids": [[7, 8, 9], [10, 11]]}


@pytest.mark.parametrize(
    ("ids", "msg"),
    [
        ([7, 8, 9], "has 1 KV cache groups but this instance has 2"),
        ([[7, 8, 9], [10, 11], [12]], "has 3 KV cache groups"),
        ([[7, 8, 9], [10]], r"remote_block_ids\[1\] has 1 blocks .* needs 2 .* window of 20"),
        ([[7, 8, 9], [10, 11, 12]], r"remote_block_ids\[1\] has 3 blocks"),
        ([[7, 8], [10, 11]], r"remote_block_ids\[0\] has 2 blocks"),
        ([[7, 8, 9], [9, 11]], "duplicates"),
        ([[7, 8, 9], [0, 11]], "null block"),
        ([[7, 8, 9], []], "length >= 1"),
        ([[7, 8, 9], ["x", 11]], "Expected `int`"),
        ([[7, 8, 9], [10, [11]]], "Expected `int`"),
        ([[7, 8, 9], 10], "Expected `array`"),
    ],
)
def test_malformed_per_group_params_are_refused(ids, msg):
    with pytest.raises(ParamsError, match=msg):
        parse_remote({**GOOD, "remote_block_ids": ids}, BS, windows=(None, WINDOW))


def test_hybrid_across_tp_sizes_is_refused():
    with pytest.raises(ParamsError, match="hybrid model .* equal tensor-parallel sizes"):
        parse_remote({**GOOD, "tp_size": 2}, BS, tp_size=1, windows=(None, WINDOW))


def test_malformed_per_group_params_fail_only_their_own_request():
    sched = _sched("eng-D")
    bad = create_request(40, max_tokens=2)
    bad.kv_transfer_params = {**GOOD, "remote_block_ids": [[7, 8, 9], [10]]}
    good = create_request(40, max_tokens=2)
    good.kv_transfer_params = {**GOOD, "remote_request_id": "p-2"}
    sched.add_request(bad)
    sched.add_request(good)
    so, _ = step(sched)
    specs = {s.req_id: s for s in so.kv_connector_metadata.reqs_to_recv}
    assert specs[bad.request_id].remote is None and "window of 20" in (
        specs[bad.request_id].error or ""
    )
    ok = specs[good.request_id]
    assert ok.error is None and ok.read_block_ids == [7, 8, 9, 10, 11]
    out = KVConnectorOutput(
        finished_recving={bad.request_id, good.request_id}, failed_recving={bad.request_id}
    )
    _, outs = step(sched, kv_output=out)
    assert [o.finish_reason for o in outs if o.request_id == bad.request_id] == ["error"]
    while sched.has_requests():
        step(sched)
    assert good.num_output_tokens == 2
    assert_no_leaks(sched)


def test_signature_covers_the_group_structure():
    signer = ParamsSigner(b"k" * 32, 60.0)
    params = decode_params(
        engine_id="eng-P",
        request_id="p-1",
        host="127.0.0.1",
        port=5555,
        block_ids=[[7, 8, 9], [10, 11]],
        num_tokens=40,
        cached_tokens=0,
        signer=signer,
    )
    remote = parse_remote(params, BS, windows=(None, WINDOW))
    check_signature(remote, signer)
    fields = remote.signed_fields()
    assert fields.block_ids == [7, 8, 9, 10, 11] and fields.group_sizes == (3, 2)
    # The same blocks cut into groups otherwise (or not at all) do not verify.
    for sizes in [(2, 3), ()]:
        with pytest.raises(NotAuthenticated, match="does not verify"):
            signer.verify(dataclasses.replace(fields, group_sizes=sizes), params["kv_signature"])
    # A claim's proof carries the sizes, so the prefill side checks the same fields.
    proof = remote.proof()
    assert proof is not None and proof.group_sizes == [3, 2]
    signer.verify(proof.fields("eng-P", "p-1", fields.block_ids), params["kv_signature"])
