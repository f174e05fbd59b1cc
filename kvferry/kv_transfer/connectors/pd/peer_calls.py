"""The decode side's side-channel calls, within their limits: per peer, overall, and in time.

At most ``max_peer_inflight`` calls to one peer at a time and ``MAX_INFLIGHT`` in all; a call
waits at most ``handshake_timeout`` for a free slot and as long again for its answer, and at
most ``MAX_WAITING`` calls queue for one peer. A dead or slow peer delays only the work for
itself. Work that may be dropped (releases, heartbeats) is given up while the peer does not
answer, logged once per outage.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from kvferry.kv_transfer.connectors.pd.codec import Codec
from kvferry.kv_transfer.connectors.pd.messages import (
    MAX_MESSAGE_BYTES,
    PeerReply,
    PeerRequest,
)
from kvferry.kv_transfer.connectors.pd.peer_table import Peer
from kvferry.kv_transfer.connectors.pd.sidechannel import PeerUnreachable, endpoint
from kvferry.kv_transfer.connectors.pd.slots import Slots

logger = logging.getLogger(__name__)

MAX_INFLIGHT = 256  # side-channel calls in flight, all peers together
MAX_WAITING = 1024  # calls waiting for a slot of one peer; beyond it new work fails at once


class GivenUp(RuntimeError):
    """Work abandoned before it reached the peer (no slot in time, too much queued)."""


class PeerCalls:
    """Requests to peers over asyncio ZeroMQ sockets (the client's loop thread only)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, codec: Codec, wait: float, label: str = "P/D"
    ) -> None:
        self.codec = codec
        self.label = label  # the transport family, for logs and errors
        self._ctx = ctx
        self._wait = wait  # for a slot, and for an answer unless a call says otherwise
        self._slots = Slots(MAX_INFLIGHT)
        self._socks: set[zmq.asyncio.Socket] = set()  # open

    def close_sockets(self) -> None:
        """Close what calls that never ended left open (the context needs every socket
        closed before it can terminate)."""
        for sock in self._socks:
            sock.close(linger=0)

    def _give_up(self, peer: Peer, why: str, droppable: str | None) -> GivenUp:
        """The error for work abandoned before it reached the peer; releases and heartbeats
        say so in the log once per outage."""
        if droppable is not None and not peer.down_logged:
            peer.down_logged = True
            logger.warning("%s: dropping %s to %s: %s", self.label, droppable, peer.label, why)
        return GivenUp(why)

    async def call(
        self,
        peer: Peer,
        request: PeerRequest,
        timeout: float | None = None,
        droppable: str | None = None,
    ) -> PeerReply:
        """One request to the peer, within the per-peer and overall limits. ``droppable``
        work (what it is, for the log) is given up while the peer does not answer."""
        wait = self._wait
        if peer.waiting >= MAX_WAITING:
            raise self._give_up(peer, "too much work is queued for it", droppable)
        peer.waiting += 1
        try:
            if not await peer.slots.take(wait):
                raise self._give_up(peer, f"no free slot for it in {wait:g}s", droppable)
            try:
                if not await self._slots.take(wait):
                    raise self._give_up(peer, f"no free side-channel slot in {wait:g}s", droppable)
            except BaseException:
                peer.slots.give()
                raise
        finally:
            peer.waiting -= 1
        if droppable is not None and time.monotonic() - peer.down_at < wait:
            self._slots.give()
            peer.slots.give()
            raise self._give_up(peer, "it does not answer", droppable)
        peer.busy += 1
        try:
            reply = await self._request(peer, request, timeout or wait)
        except PeerUnreachable:
            peer.down_at = time.monotonic()
            raise
        finally:
            peer.busy -= 1
            self._slots.give()
            peer.slots.give()
        peer.down_at, peer.down_logged = -1e9, False
        return reply

    async def _request(self, peer: Peer, request: PeerRequest, timeout: float) -> PeerReply:
        host, port, _ = peer.addr
        where = f"{host}:{port}"
        sock = self._ctx.socket(zmq.REQ)
        self._socks.add(sock)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(endpoint(host, port))
            frame, nonce = self.codec.encode_request(request)
            await sock.send(frame)
            try:
                data = await asyncio.wait_for(sock.recv(), timeout)
            except asyncio.TimeoutError:
                raise PeerUnreachable(
                    f"no answer from the {self.label} side channel {where} in {timeout:g}s"
                ) from None
            return self.codec.decode_reply(data, where, nonce)
        except zmq.ZMQError as e:
            raise PeerUnreachable(f"{self.label} side channel {where}: {e}") from None
        finally:
            self._socks.discard(sock)
            sock.close()
