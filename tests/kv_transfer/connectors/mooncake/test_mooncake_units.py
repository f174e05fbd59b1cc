"""MooncakeConnector pieces without engine processes: a worker-to-worker read over Mooncake's
transfer engine (two engines in this process, TCP on loopback) checked byte for byte, the
transport's block runs and refusals, options, the compatibility description, and the vLLM
MooncakeConnector fields of its params."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.mooncake import MooncakeConnector
from kvferry.kv_transfer.connectors.mooncake.scheduler import MooncakeConnectorScheduler
from kvferry.kv_transfer.connectors.mooncake.transport import block_runs
from kvferry.kv_transfer.connectors.pd import handshake as hs
from kvferry.kv_transfer.connectors.pd.metadata import (
    PDConnectorMetadata,
    RecvSpec,
    RemoteRef,
    SendSpec,
)
from kvferry.kv_transfer.connectors.pd.params import ParamsError, token_digest
from tests.helpers.mooncake_pd import mooncake_engine_config
from tests.helpers.scheduler import make_kv_cache_config

pytest.importorskip("mooncake.engine", reason="needs Mooncake's transfer engine (extra 'mooncake')")

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")
SHAPE = (2, 32, 16, 1, 8)


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    assert block_runs([20, 21, 22, 5], [3, 4, 5, 6]) == [(20, 3, 3), (5, 6, 1)]
    assert block_runs([1, 3], [2, 3]) == [(1, 2, 1), (3, 3, 1)]
    assert block_runs([], []) == []


def test_worker_to_worker_read_moves_exactly_the_named_blocks():
    kvc = make_kv_cache_config(32)
    src = {name: torch.randn(SHAPE) for name in LAYERS}
    dst = {name: torch.zeros(SHAPE) for name in LAYERS}
    p = MooncakeConnector(mooncake_engine_config("eng-P"), KVConnectorRole.WORKER, kvc)
    d = MooncakeConnector(mooncake_engine_config("eng-D"), KVConnectorRole.WORKER, kvc)
    try:
        p.register_kv_caches(src)
        d.register_kv_caches(dst)
        pw, dw = p.connector_worker, d.connector_worker
        assert pw is not None and dw is not None
        digest = token_digest(list(range(60)), 60)
        held = [3, 4, 9, 10]
        pw.bind(PDConnectorMetadata(reqs_to_send=[SendSpec("p-1", held, 60, digest)]))
        ref = RemoteRef("eng-P", "127.0.0.1", pw.port, "p-1")
        local = [20, 21, 11]  # blocks 4, 9, 10: a run of two and one of one on each side
        spec = RecvSpec("d-1", ref, held, local, 60, digest, first_block=1)
        dw.start_load(PDConnectorMetadata(reqs_to_recv=[spec]), empty_step=True)
        sent: set[str] = set()
        got: set[str] = set()
        deadline = time.monotonic() + 20
        while not (sent and got) and time.monotonic() < deadline:
            got |= dw.get_finished()[1]
            sent |= pw.get_finished()[0]
        # The prefill side ended its hold on Mooncake's notification, not at lease expiry.
        assert got == {"d-1"} and sent == {"p-1"} and not dw.get_failed_recving()
        for name in LAYERS:
            s, t = src[name], dst[name]
            assert torch.equal(t[:, local], s[:, [4, 9, 10]])  # K and V of the tail blocks
            untouched = [b for b in range(32) if b not in local]
            assert not t[:, untouched].any()
        stats = d.get_kv_connector_stats()
        assert stats is not None and stats.data["mooncake_read_bytes"] == 2 * 2 * 3 * 16 * 8 * 4
    finally:
        p.shutdown()
        d.shutdown()


def test_transport_refuses_a_peer_without_a_session():
    from kvferry.kv_transfer.connectors.mooncake.transport import MooncakeTransport

    t = MooncakeTransport("agent-x", "127.0.0.1", threads=1)
    try:
        for bad in (b"\xff\xfe", b"no-port", b"host:99999999", b"a b:1"):
            info = hs.AgentInfo("P", "agent-P", bad, 0, 1, 16, 32, 512, "DRAM", 0, [4096])
            with pytest.raises(hs.ProtocolError, match="no Mooncake session"):
                t.add_peer(info)
    finally:
        t.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mooncake_protocol": "udp"}, "mooncake_protocol must be one of"),
        ({"transfer_threads": 0}, "transfer_threads must be between 1 and 256"),
        ({"backends": ["UCX"]}, "valid options are"),  # a NIXL key is not a Mooncake one
        ({"kv_lease_duration": -1}, "kv_lease_duration must be a positive number"),
    ],
)
def test_bad_options_are_refused_clearly(extra: dict[str, Any], message: str):
    kvc = make_kv_cache_config(32)
    with pytest.raises(ConfigError, match=message):
        MooncakeConnector(mooncake_engine_config("e", **extra), KVConnectorRole.SCHEDULER, kvc)


def test_compat_names_the_transport_so_nixl_and_mooncake_never_pair():
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="/nonexistent/tiny", arch="a"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    config.model_config.arch = SimpleNamespace(architecture="LlamaForCausalLM")
    kvc = make_kv_cache_config(32)
    nixl = hs.Compat.of(config, kvc)  # type: ignore[arg-type]
    mooncake = hs.Compat.of(config, kvc, "mooncake")  # type: ignore[arg-type]
    assert mooncake.desc == nixl.desc + " transport=mooncake"
    assert mooncake.hash != nixl.hash


def _scheduler() -> MooncakeConnectorScheduler:
    conn = MooncakeConnector(
        mooncake_engine_config("eng-P", side_channel_port=5555),
        KVConnectorRole.SCHEDULER,
        make_kv_cache_config(32),
    )
    sched = conn.connector_scheduler
    assert isinstance(sched, MooncakeConnectorScheduler)
    return sched


def test_params_carry_vllm_mooncake_fields_and_refuse_contradictions():
    sched = _scheduler()
    request = SimpleNamespace(request_id="p-7", kv_transfer_params={"do_remote_decode": True})
    assert sched.extra_params(request, "127.0.0.1", 5555) == {  # type: ignore[arg-type]
        "transfer_id": "p-7",
        "remote_bootstrap_addr": "tcp://127.0.0.1:5555",
    }
    request.kv_transfer_params = {"do_remote_decode": True, "transfer_id": "xfer-1"}
    assert sched.extra_params(request, "h", 1)["transfer_id"] == "xfer-1"  # type: ignore[arg-type]
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "eng-P",
        "remote_request_id": "p-7",
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 20,
        "transfer_id": "p-7",
        "remote_bootstrap_addr": "tcp://127.0.0.1:5555",
    }
    sched.validate(good)
    sched.validate({k: v for k, v in good.items() if k != "remote_bootstrap_addr"})
    with pytest.raises(ParamsError, match="remote_bootstrap_addr"):
        sched.validate({**good, "remote_bootstrap_addr": "tcp://10.0.0.1:5555"})
    with pytest.raises(ParamsError, match="transfer_id must be a string"):
        sched.validate({**good, "transfer_id": 7})


def test_batch_entries_share_mooncakes_per_peer_queue_between_threads():
    from kvferry.kv_transfer.connectors.mooncake.transport import QUEUE_ENV, batch_entries

    assert batch_entries(4, {}) == 256  # Mooncake's default queue of 1024 entries per peer
    assert batch_entries(1, {QUEUE_ENV: "4096"}) == 4096
    assert batch_entries(3, {QUEUE_ENV: "2"}) == 1
    for bad in ("0", "70000", "x", ""):  # what Mooncake ignores, we do too
        assert batch_entries(2, {QUEUE_ENV: bad}) == 512


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_read_of_more_pieces_than_mooncakes_queue_moves_every_byte_and_notifies_once():
    """Across TP sizes a READ is one piece per token row: far more entries than Mooncake's
    per-peer queue (1024) admits in one batch. Every piece lands, the peer gets one
    notification, after the data."""
    from kvferry.kv_transfer.connectors.mooncake.transport import MooncakeTransport

    shape = (2, 128, 16, 2, 8)  # decode rank 0 of 2 keeps head 0 of each token row
    src = {name: torch.randn(shape) for name in LAYERS}
    dst = {name: torch.zeros(2, 128, 16, 1, 8) for name in LAYERS}
    p = MooncakeTransport("agent-P", "127.0.0.1", threads=2)
    d = MooncakeTransport("agent-D", "127.0.0.1", threads=2)
    try:
        pl, dl = p.register(src), d.register(dst)
        info = hs.AgentInfo(
            "P", "agent-P", p.metadata(), 0, 1, 16, 128, pl.block_bytes, "DRAM", 0,
            list(pl.base_addrs),
        )  # fmt: skip
        peer = d.add_peer(info)
        from kvferry.kv_transfer.connectors.pd.tp_slices import head_slice, pieces

        blocks = list(range(0, 128, 2))  # 2 layers x K/V x 64 blocks x 16 rows
        sl = head_slice(0, 2, 0, 1, dl, peer.layout)
        local, far, n = pieces(dl, peer.layout, blocks, blocks, sl)
        # More than Mooncake's queue and admission backlog (1024 each) take at once.
        assert len(local) == 4096 and d.batch_entries == 512
        handle, _ = d.read_pieces(peer, local, far, n, b"done")
        _wait(lambda: d.state(handle) != "PROC", "the READ")
        assert d.state(handle) == "DONE"
        notes: dict[str, list[bytes]] = {}
        _wait(lambda: bool(notes.update(p.notifs()) or notes), "the notification")
        time.sleep(0.2)
        notes.update({k: notes.get(k, []) + v for k, v in p.notifs().items()})
        assert notes == {"agent-D": [b"done"]}
        for name in LAYERS:
            assert torch.equal(dst[name][:, blocks], src[name][:, blocks, :, :1])
            assert not dst[name][:, 1::2].any()
    finally:
        d.close()
        p.close()
