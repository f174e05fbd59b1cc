"""Mooncake's transfer engine behind the P/D connector (its ``KVTransport``, see
:mod:`kvferry.kv_transfer.connectors.pd.transport`).

One ``mooncake.engine.TransferEngine`` per worker, started with the ``P2PHANDSHAKE``
metadata mode (no etcd, no master: peers find each other's segments through the engine's
own RPC port) over TCP, or RDMA where the machine has it. Each layer's KV tensor is one
registered region; a peer is its engine's session name (``host:rpc_port``), announced in the
handshake.

A READ is one ``batch_transfer_sync`` call with a ``TransferNotify``: Mooncake delivers the
notification to the peer only after the data, which is what the prefill side's lease needs.
The call blocks (without the GIL), so it runs on a small thread pool and its future is the
transfer handle: ``PROC`` while it runs, ``DONE`` on success. Mooncake cannot cancel a
transfer in flight; :meth:`MooncakeTransport.release` says so until it has ended, and the
reader keeps the request's blocks until then. Runs of consecutive blocks on both sides merge
into one transfer entry per (layer, K|V, run).

Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` entries per
peer (1024 unless set) and fails a batch that overflows the queue; a READ across
tensor-parallel sizes has one entry per token row (thousands for a long prompt). So a READ
is posted as consecutive batches of at most :func:`batch_entries` entries, the queue's share
of one transfer thread (the threads may all read one peer), in the same thread, one after
the other; only the last carries the notification, so the peer still gets it after all the
data.

Notification payloads travel as text in Mooncake, so our (binary) notification is base64.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvferry.kv_transfer.connectors.pd.handshake import AgentInfo, ProtocolError
from kvferry.kv_transfer.connectors.pd.transport import DONE, PROC, KVLayout

logger = logging.getLogger(__name__)

_SESSION = re.compile(r"^[A-Za-z0-9.:\[\]_-]{1,255}:[0-9]{1,5}$")

# Mooncake's own knob, read the way its TCP transport reads it (digits, 1..65535, else 1024).
QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_QUEUE_DEFAULT, _QUEUE_MAX = 1024, 65535


def batch_entries(threads: int, env: Mapping[str, str] = os.environ) -> int:
    """The most entries one ``batch_transfer_sync`` call may carry: the per-peer queue
    shared by ``threads`` transfer threads, so concurrent READs of one peer never overflow it."""
    text = env.get(QUEUE_ENV, "")
    queue = int(text) if text.isdigit() and 1 <= int(text) <= _QUEUE_MAX else _QUEUE_DEFAULT
    return max(1, queue // max(1, threads))


@dataclass(frozen=True)
class MooncakePeer:
    name: str
    layout: KVLayout
    session: str  # the peer engine's "host:rpc_port"


def block_runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(local_first, remote_first, count)`` for each run consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for lo, re_ in zip(local_ids, remote_ids, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if lo == l0 + n and re_ == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lo, re_, 1))
    return runs


class MooncakeTransport:
    label = "Mooncake"

    def __init__(
        self,
        name: str,
        hostname: str,
        protocol: str = "tcp",
        device_name: str = "",
        threads: int = 4,
    ) -> None:
        try:
            from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        except ImportError as e:
            raise RuntimeError(
                f"MooncakeConnector needs Mooncake's transfer engine (pip install "
                f"mooncake-transfer-engine, or -non-cuda without a GPU): {e}"
            ) from None
        self._notify, self._read_op = TransferNotify, TransferOpcode.Read
        self.name = name
        self.protocol = protocol
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"MooncakeConnector: Mooncake's transfer engine did not start on {hostname} "
                f"with protocol {protocol!r} (code {rc}; its log above says why)"
            )
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mooncake-read")
        self.batch_entries = batch_entries(threads)
        self._registered: list[int] = []
        self.layout: KVLayout | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        layout = KVLayout.of_caches(kv_caches)
        for addr in layout.base_addrs:
            rc = self.engine.register_memory(addr, layout.region_bytes)
            if rc != 0:
                raise RuntimeError(f"MooncakeConnector: registering the KV pool failed ({rc})")
            self._registered.append(addr)
        self.layout = layout
        return layout

    def describe(self) -> str:
        return f"protocol={self.protocol} session={self.session}"

    def metadata(self) -> bytes:
        return self.session.encode()

    def add_peer(self, info: AgentInfo) -> MooncakePeer:
        try:
            session = info.agent_metadata.decode("ascii")
        except UnicodeDecodeError:
            session = ""
        if not _SESSION.match(session):
            raise ProtocolError(
                f"peer {info.agent_name!r} announced no Mooncake session (host:port)"
            )
        return MooncakePeer(info.agent_name, KVLayout.of_peer(info), session)

    def remove_peer(self, peer: Any) -> None:
        # The engine keeps no per-peer state we could drop (it caches segments itself).
        logger.debug("Mooncake: forgetting peer %s", getattr(peer, "name", peer))

    def read(
        self, peer: Any, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> tuple[Any, str]:
        assert self.layout is not None and isinstance(peer, MooncakePeer)
        if not local_ids or len(local_ids) != len(remote_ids):
            raise ValueError("Mooncake: a READ needs as many local as remote blocks, at least one")
        local, remote = self.layout, peer.layout
        bb = local.block_bytes
        bufs: list[int] = []
        peer_addrs: list[int] = []
        lens: list[int] = []
        for l_base, r_base in zip(local.base_addrs, remote.base_addrs, strict=True):
            for kv in (0, 1):
                l_half = l_base + kv * local.num_blocks * bb
                r_half = r_base + kv * remote.num_blocks * bb
                for l0, r0, n in block_runs(local_ids, remote_ids):
                    bufs.append(l_half + l0 * bb)
                    peer_addrs.append(r_half + r0 * bb)
                    lens.append(n * bb)
        message = base64.b64encode(notif).decode("ascii")
        handle = self._pool.submit(self._transfer, peer.session, bufs, peer_addrs, lens, message)
        return handle, PROC

    def read_pieces(
        self,
        peer: Any,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        length: int,
        notif: bytes,
    ) -> tuple[Any, str]:
        assert isinstance(peer, MooncakePeer)
        bufs = [int(a) for a in local_addrs]
        peer_addrs = [int(a) for a in remote_addrs]
        message = base64.b64encode(notif).decode("ascii")
        handle = self._pool.submit(
            self._transfer, peer.session, bufs, peer_addrs, [length] * len(bufs), message
        )
        return handle, PROC

    def _transfer(
        self, session: str, bufs: list[int], peer_addrs: list[int], lens: list[int], message: str
    ) -> int:
        """Run one READ as consecutive batches (see the module docstring); 0 on success, else
        the first failing batch's code (later batches and the notification are not sent)."""
        n, step = len(bufs), self.batch_entries
        for start in range(0, n, step):
            end = min(start + step, n)
            note = self._notify(self.name, message) if end == n else None
            rc = int(
                self.engine.batch_transfer_sync(
                    session,
                    bufs[start:end],
                    peer_addrs[start:end],
                    lens[start:end],
                    self._read_op,
                    note,
                )
            )
            if rc != 0:
                return rc
        return 0

    def state(self, handle: Any) -> str:
        assert isinstance(handle, Future)
        if not handle.done():
            return PROC
        rc = handle.result()  # raises what the transfer raised
        return DONE if rc == 0 else f"ERR({rc})"

    def release(self, handle: Any) -> bool:
        """A transfer cannot be cancelled: released once it has ended."""
        assert isinstance(handle, Future)
        return handle.done()

    def notifs(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for note in self.engine.get_notifies():
            try:
                data = base64.b64decode(note.msg, validate=True)
            except (binascii.Error, ValueError):
                data = b""  # fails decoding as a notification: counted and logged there
            out.setdefault(str(note.name), []).append(data)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for addr in self._registered:
            try:
                self.engine.unregister_memory(addr)
            except Exception as e:
                logger.debug("Mooncake: close: %s", e)
        self._registered.clear()
