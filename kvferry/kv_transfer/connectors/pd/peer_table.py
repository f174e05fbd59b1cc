"""The peers the decode side's side-channel client knows: one :class:`Peer` per address, with
its slots, cached agent info, failure cache and outage state, in a bounded :class:`PeerTable`.

A peer is one side-channel address: host, port and the engine id named there. Everything
here is touched on the client's loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.kv_transfer.connectors.pd.messages import AgentInfo
from kvferry.kv_transfer.connectors.pd.metadata import RemoteRef
from kvferry.kv_transfer.connectors.pd.slots import Slots

Addr = tuple[str, int, str]  # a peer: side-channel host, port, and the engine id named there

MAX_PEERS = 4096  # idle peers beyond this are forgotten, oldest first


def addr_of(ref: RemoteRef) -> Addr:
    return (ref.host, ref.port, ref.engine_id)


@dataclass
class Peer:
    addr: Addr
    slots: Slots
    handshake: asyncio.Lock = field(default_factory=asyncio.Lock)
    info: AgentInfo | None = None
    failed_at: float = -1e9  # last failed handshake or unanswered claim
    failure: str = ""
    down_at: float = -1e9  # last call that got no answer
    down_logged: bool = False
    waiting: int = 0
    busy: int = 0
    beating: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        host, port, engine_id = self.addr
        return f"{host}:{port} (engine {engine_id})"

    def idle(self) -> bool:
        return not (self.busy or self.waiting or self.beating or self.handshake.locked())

    def failed(self, failure: str) -> None:
        """Remember why the last handshake or claim failed; handshake afresh after it."""
        self.failed_at, self.failure, self.info = time.monotonic(), failure, None

    def failed_within(self, window: float) -> bool:
        return time.monotonic() - self.failed_at < window


class PeerTable:
    """Peers by address, the most recently used last."""

    def __init__(self, max_inflight: int) -> None:
        self._max_inflight = max_inflight  # calls to one peer at a time
        self._peers: OrderedDict[Addr, Peer] = OrderedDict()

    def at(self, addr: Addr) -> Peer:
        """The peer at ``addr``, made on first use; a new one beyond ``MAX_PEERS`` pushes out
        the least recently used idle peer (none while every peer is busy)."""
        peer = self._peers.get(addr)
        if peer is None:
            peer = self._peers[addr] = Peer(addr, Slots(self._max_inflight))
            if len(self._peers) > MAX_PEERS:
                old = next((p for p in self._peers.values() if p.idle() and p is not peer), None)
                if old is not None:
                    del self._peers[old.addr]
        self._peers.move_to_end(addr)
        return peer

    def forget(self, addr: Addr) -> None:
        """Drop the cached agent info at ``addr``, if any."""
        peer = self._peers.get(addr)
        if peer is not None:
            peer.info = None
