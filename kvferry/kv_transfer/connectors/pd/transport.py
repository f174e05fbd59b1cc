"""What the P/D machinery needs from a transfer library, and the KV pool layout it moves.

The side channel, leases, claims, heartbeats and the reader (this package) are one
implementation; the library that moves the bytes sits behind :class:`KVTransport`, a small
protocol that ``NixlTransport`` (``connectors/nixl``) and ``MooncakeTransport``
(``connectors/mooncake``) both satisfy.

A transport registers the local pool, describes it to peers (:meth:`KVTransport.metadata`,
carried opaquely in the handshake's ``AgentInfo``), loads a peer from that description, and
posts block-granular READs from a peer's pool into ours. Each READ carries a notification
(opaque bytes) that the transport delivers to the peer *after* the data, where the peer's
:meth:`KVTransport.notifs` returns it, keyed by the reader's transport name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kvferry.kv_layout import KVCacheLayout, layout_of

if TYPE_CHECKING:
    from kvferry.kv_transfer.connectors.pd.messages import AgentInfo

# The states :meth:`KVTransport.state` reports; anything else counts as failed.
PROC = "PROC"  # still running
DONE = "DONE"  # complete, the notification sent after the data


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
    # HND pool: inside a block each head's rows are together. A peer's comes from the
    # layout its handshake names (which may differ from ours, see .layout_match).
    heads_outer: bool = False

    @staticmethod
    def of_caches(kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        # Layers of a hybrid model's groups share tensors (a block belongs to one group at
        # a time): each tensor is one region, registered once.
        tensors = list({t.data_ptr(): t for t in kv_caches.values()}.values())
        if not tensors:
            raise ValueError("P/D connector: no KV cache tensors to register")
        first = tensors[0]
        for t in tensors:
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("P/D connector: all KV cache layers must share shape and dtype")
            if layout_of(t) is None or t.shape[0] != 2:
                raise ValueError(
                    "P/D connector: KV caches must be (2, N, B, H, D) dense in NHD or HND order"
                )
        block_bytes = first[0, 0].numel() * first.element_size()
        dev = first.get_device()
        return KVLayout(
            num_blocks=first.shape[1],
            block_bytes=block_bytes,
            block_size=first.shape[2],
            mem_type="VRAM" if dev >= 0 else "DRAM",
            device_id=max(dev, 0),
            base_addrs=tuple(t.data_ptr() for t in tensors),
            # By the strides, which keep the head stride of an HND pool with one head per rank
            # (whose block is dense in either order, but not its peer's of more heads).
            heads_outer=first.shape[2] > 1 and first.stride(3) == first.shape[2] * first.shape[4],
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
            heads_outer=info.kv_cache_layout == KVCacheLayout.HND.value,
        )

    @property
    def num_layers(self) -> int:
        return len(self.base_addrs)

    @property
    def region_bytes(self) -> int:
        """Bytes of one layer's tensor (K and V of every block)."""
        return 2 * self.num_blocks * self.block_bytes

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


class RemotePeer(Protocol):
    """A peer's pool as a transport loaded it."""

    @property
    def name(self) -> str: ...

    @property
    def layout(self) -> KVLayout: ...


class KVTransport(Protocol):
    """The transfer library behind a P/D connector. All calls come from the engine thread,
    except :meth:`metadata` (read once at registration)."""

    #: This transport's name, unique per worker: peers key our notifications by it.
    name: str
    #: Short name for logs and errors ("NIXL", "Mooncake").
    label: str

    def register(self, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        """Register the local pool with the library; returns its layout."""
        ...

    def describe(self) -> str:
        """One line for the start-up log: backends or protocol in use."""
        ...

    def metadata(self) -> bytes:
        """What a peer needs to load us (:meth:`add_peer` there)."""
        ...

    def add_peer(self, info: AgentInfo) -> RemotePeer:
        """Load a peer from its handshake; raises on metadata that cannot be used."""
        ...

    # Peers are typed Any below: each transport takes back only the peers it made.
    def remove_peer(self, peer: Any) -> None:
        """Unload a peer (best effort: it may be gone already)."""
        ...

    def read(
        self, peer: Any, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> tuple[Any, str]:
        """Post a READ of the peer's ``remote_ids`` into ``local_ids`` (every layer, K and
        V), with ``notif`` delivered to the peer after the data; returns (handle, state)."""
        ...

    def read_pieces(
        self,
        peer: Any,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        length: int,
        notif: bytes,
    ) -> tuple[Any, str]:
        """Post a READ of ``length`` bytes at each of ``remote_addrs`` (inside the peer's pool)
        to the matching ``local_addrs`` (inside ours), with ``notif`` as in :meth:`read`; used
        across tensor-parallel sizes (:mod:`.tp_slices`)."""
        ...

    def state(self, handle: Any) -> str:
        """:data:`PROC`, :data:`DONE`, or anything else for failed; may raise."""
        ...

    def release(self, handle: Any) -> bool:
        """Release a handle, cancelling it if still active; False if that is not possible
        yet (the READ may still write into the local blocks)."""
        ...

    def notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by the sending transport's name."""
        ...

    def close(self) -> None:
        """Deregister the pool; no call follows."""
        ...
