"""The NIXL library behind the connector: one agent per worker, the KV pool registered with
it, and block-granular READs from a peer's pool.

Every layer's KV tensor ``(2, num_blocks, block_size, kv_heads, head_dim)`` is one registered
region. Transfers use one descriptor per (layer, K|V, block) in that order, so a request's
blocks map to the same descriptor indices on both sides and runs of consecutive blocks merge
into single large transfers. Host tensors are registered as DRAM, CUDA tensors as VRAM: the
same code moves host memory over TCP and device memory over RDMA/NVLink, as UCX allows.

All calls must come from one thread (the engine's); the agent is created without locking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvferry.kv_transfer.connectors.nixl.handshake import AgentInfo, ProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """Where every block of a KV pool lives: K block b of layer l at
    ``base_addrs[l] + b * block_bytes``, its V block ``num_blocks * block_bytes`` further."""

    num_blocks: int
    block_bytes: int
    block_size: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    base_addrs: tuple[int, ...]

    @staticmethod
    def of_caches(kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("NixlConnector: no KV cache tensors to register")
        first = tensors[0]
        for t in tensors:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("NixlConnector: all KV cache layers must share shape and dtype")
            if not t.is_contiguous() or t.dim() != 5 or t.shape[0] != 2:
                raise ValueError("NixlConnector: KV caches must be contiguous (2, N, B, H, D)")
        block_bytes = first[0, 0].numel() * first.element_size()
        dev = first.get_device()
        return KVLayout(
            num_blocks=first.shape[1],
            block_bytes=block_bytes,
            block_size=first.shape[2],
            mem_type="VRAM" if dev >= 0 else "DRAM",
            device_id=max(dev, 0),
            base_addrs=tuple(t.data_ptr() for t in tensors),
        )

    @staticmethod
    def of_peer(info: AgentInfo) -> KVLayout:
        return KVLayout(
            info.num_blocks,
            info.block_bytes,
            info.block_size,
            info.mem_type,
            info.device_id,
            tuple(info.base_addrs),
        )

    @property
    def num_layers(self) -> int:
        return len(self.base_addrs)

    def descs(self) -> np.ndarray:
        """One ``(addr, len, device)`` row per (layer, K|V, block)."""
        nb, bb = self.num_blocks, self.block_bytes
        bases = np.array(self.base_addrs, dtype=np.uint64)
        offs = (np.arange(2 * nb, dtype=np.uint64) * np.uint64(bb)).reshape(1, 2 * nb)
        out = np.empty((self.num_layers * 2 * nb, 3), dtype=np.uint64)
        out[:, 0] = (bases[:, None] + offs).ravel()
        out[:, 1] = bb
        out[:, 2] = self.device_id
        return out

    def indices(self, block_ids: list[int]) -> np.ndarray:
        """Descriptor indices of ``block_ids`` in every layer, K and V, in :meth:`descs` order."""
        ids = np.asarray(block_ids, dtype=np.int64)
        rows = np.arange(2 * self.num_layers, dtype=np.int64)[:, None] * self.num_blocks
        return (rows + ids[None, :]).ravel().astype(np.int32)


@dataclass
class RemotePeer:
    name: str
    layout: KVLayout
    dlist: Any  # nixl_prepped_dlist_handle


class NixlTransport:
    def __init__(self, name: str, backends: list[str], num_threads: int = 0) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"NixlConnector needs the nixl package: {e}") from None
        cfg = nixl_agent_config(backends=list(backends), num_threads=num_threads)
        self.name = name
        self.agent = nixl_agent(name, cfg)
        if not self.agent.backends:
            raise RuntimeError(
                f"NixlConnector: none of the NIXL backends {backends} could be created "
                f"(plugins found: {self.agent.get_plugin_list()})"
            )
        self._reg: Any = None
        self._local: Any = None
        self.layout: KVLayout | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        layout = KVLayout.of_caches(kv_caches)
        self._reg = self.agent.register_memory(list(kv_caches.values()))
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", layout.descs(), layout.mem_type)
        self.layout = layout
        return layout

    @property
    def local_dlist(self) -> Any:
        """The prepared descriptor list of the local pool (for raw transfers in benchmarks)."""
        return self._local

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, info: AgentInfo) -> RemotePeer:
        raw = self.agent.add_remote_agent(info.agent_metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if name != info.agent_name:
            self.agent.remove_remote_agent(name)
            raise ProtocolError(
                f"peer announced NIXL agent {info.agent_name!r} but its metadata is {name!r}"
            )
        layout = KVLayout.of_peer(info)
        dlist = self.agent.prep_xfer_dlist(name, layout.descs(), layout.mem_type)
        return RemotePeer(name, layout, dlist)

    def remove_peer(self, peer: RemotePeer) -> None:
        try:
            peer.dlist.release()
            self.agent.remove_remote_agent(peer.name)
        except Exception as e:  # the peer may be gone already
            logger.debug("NIXL: removing peer %s: %s", peer.name, e)

    def read(
        self, peer: RemotePeer, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> tuple[Any, str]:
        """Post a READ of ``remote_ids`` into ``local_ids``; returns (handle, state)."""
        assert self.layout is not None
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local,
            self.layout.indices(local_ids),
            peer.dlist,
            peer.layout.indices(remote_ids),
            notif,
        )
        try:
            return handle, self.agent.transfer(handle)
        except Exception:
            self.release(handle)
            raise

    def state(self, handle: Any) -> str:
        return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> bool:
        """Release a transfer handle (cancelling it if still active); False if NIXL refused."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as e:
            logger.warning("NIXL: cannot release a transfer handle yet: %s", e)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        return dict(self.agent.get_new_notifs())

    def close(self) -> None:
        try:
            if self._local is not None:
                self._local.release()
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("NIXL: close: %s", e)
        self._local = self._reg = None
