"""Raw reads of the transfer libraries, beside the P/D connectors that use them.

Each function times one read between the decode child's and the prefill child's engines
(the very agents / transfer engines the connectors created, after the connector's own first
read loaded the peer), with none of the P/D machinery: no side channel, claim, lease,
notification or polling thread.

* :func:`nixl_raw_read`: NIXL ``make_prepped_xfer`` + ``transfer`` + polling
  ``check_xfer_state`` of the descriptors the NixlConnector reads (one per layer, K|V, block).
* :func:`mooncake_raw_read`: one ``batch_transfer_sync_read`` of the entries the
  MooncakeConnector posts (:func:`mooncake_entries`: one per layer, K|V, run of consecutive
  blocks), on the calling thread.
* :func:`mooncake_contiguous_read`: one ``transfer_sync_read`` of one contiguous region of
  the same size (a separately registered buffer on each side): the engine's ceiling for
  those bytes on this machine.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry.kv_transfer.connectors.mooncake.transport import block_runs
from kvferry.kv_transfer.connectors.pd.transport import KVLayout


def _peer(conn: Any, peer_engine_id: str) -> Any:
    peer = conn.connector_worker.reader.peer(peer_engine_id)
    if peer is None:
        raise RuntimeError(f"no peer {peer_engine_id!r} loaded: read through the connector first")
    return peer


def nixl_raw_read(conn: Any, peer_engine_id: str, blocks: list[int]) -> float:
    """Seconds of a raw NIXL READ of ``blocks`` (same ids both sides) between the
    NixlConnector's agent and its peer's."""
    transport = conn.connector_worker.transport
    peer = _peer(conn, peer_engine_id)
    agent = transport.agent
    t0 = time.perf_counter()
    handle = agent.make_prepped_xfer(
        "READ",
        transport.local_dlist,
        transport.layout.indices(blocks),
        peer.dlist,
        peer.layout.indices(blocks),
        b"",
    )
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL READ ended in state {state}")
    return seconds


def mooncake_entries(
    local: KVLayout, remote: KVLayout, local_ids: list[int], remote_ids: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, peer addresses, lengths): one entry per (layer, K|V, run of blocks
    consecutive on both sides), the batching ``MooncakeTransport.read`` uses."""
    bb = local.block_bytes
    bufs: list[int] = []
    peer_addrs: list[int] = []
    lens: list[int] = []
    runs = block_runs(local_ids, remote_ids)
    for l_base, r_base in zip(local.base_addrs, remote.base_addrs, strict=True):
        for kv in (0, 1):
            l_half = l_base + kv * local.num_blocks * bb
            r_half = r_base + kv * remote.num_blocks * bb
            for l0, r0, n in runs:
                bufs.append(l_half + l0 * bb)
                peer_addrs.append(r_half + r0 * bb)
                lens.append(n * bb)
    return bufs, peer_addrs, lens


def mooncake_raw_read(conn: Any, peer_engine_id: str, blocks: list[int]) -> float:
    """Seconds of one batched Mooncake read of ``blocks`` between the MooncakeConnector's
    transfer engine and its peer's (the entries are built before the clock starts)."""
    transport = conn.connector_worker.transport
    peer = _peer(conn, peer_engine_id)
    bufs, peer_addrs, lens = mooncake_entries(transport.layout, peer.layout, blocks, blocks)
    t0 = time.perf_counter()
    rc = transport.engine.batch_transfer_sync_read(peer.session, bufs, peer_addrs, lens)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"raw Mooncake batch read failed ({rc})")
    return seconds


def mooncake_session(conn: Any, peer_engine_id: str) -> str:
    """The peer engine's Mooncake session name (``host:rpc_port``)."""
    return str(_peer(conn, peer_engine_id).session)


def register_scratch(conn: Any, nbytes: int, device: str, fill: bytes | None = None) -> Any:
    """A contiguous ``nbytes`` buffer registered with the MooncakeConnector's transfer
    engine (``fill``: its content, else zeros); the caller keeps it alive."""
    import torch

    if fill is not None:
        buf = torch.frombuffer(bytearray(fill), dtype=torch.uint8).to(device)
    else:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    rc = conn.connector_worker.transport.engine.register_memory(buf.data_ptr(), nbytes)
    if rc != 0:
        raise RuntimeError(f"registering the contiguous buffer with Mooncake failed ({rc})")
    return buf


def unregister_scratch(conn: Any, buf: Any) -> None:
    conn.connector_worker.transport.engine.unregister_memory(buf.data_ptr())


def mooncake_contiguous_read(
    conn: Any, session: str, local_addr: int, remote_addr: int, nbytes: int
) -> float:
    """Seconds of one contiguous ``nbytes`` Mooncake read between registered buffers."""
    engine = conn.connector_worker.transport.engine
    t0 = time.perf_counter()
    rc = engine.transfer_sync_read(session, local_addr, remote_addr, nbytes)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"contiguous Mooncake read failed ({rc})")
    return seconds


def scratch_pattern(nbytes: int, seed: int) -> bytes:
    """Seeded bytes for the contiguous buffers, so a read can be checked."""
    import numpy as np

    # random.randbytes cannot make more than 256 MiB at once.
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
