"""The decode side's side-channel client: handshakes, claims, heartbeats and releases.

Every call runs on one asyncio loop in a background thread (ZeroMQ sockets; the transport
is never touched here), so a call waiting for its answer costs a socket, not a thread. Work
is kept per *peer* (:mod:`.peer_table`) and sent within the limits of :mod:`.peer_calls`.

* A handshake fetches and checks the peer's agent info (engine id, KV layout, after the
  compatibility hash), cached per peer. After a failed handshake or an unanswered claim, new
  reads from that peer fail at once for ``handshake_timeout`` instead of each waiting for
  the timeout; another address, even one naming the same engine id, is not affected.
* Under tensor parallelism rank r of this engine reads the prefill ranks :mod:`.tp_slices`
  names (rank r itself at equal TP): the params name the prefill engine's rank 0, which
  answers a handshake for rank s with a :class:`Redirect` to that rank's side channel; every
  call for rank s then goes there. Heartbeats and releases go to every source rank.
* A claim asks the prefill engine to keep exactly the named blocks for this reader and says
  for how long. Heartbeats are coalesced (one in flight per peer and purpose). A release
  resolves once the peer answered or the release was given up; both it and heartbeats are
  dropped while the peer does not answer (logged once per outage).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.connectors.pd.codec import Codec, ProtocolError
from kvferry.kv_transfer.connectors.pd.layout_match import check_peer_layout
from kvferry.kv_transfer.connectors.pd.messages import (
    AgentInfo,
    ClaimRequest,
    Granted,
    HandshakeRequest,
    HeartbeatRequest,
    PeerReply,
    Redirect,
    Refused,
    ReleaseRequest,
    Renewed,
)
from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef
from kvferry.kv_transfer.connectors.pd.options import PDOptions
from kvferry.kv_transfer.connectors.pd.peer_calls import GivenUp, PeerCalls
from kvferry.kv_transfer.connectors.pd.peer_table import Addr, Peer, PeerTable, addr_of
from kvferry.kv_transfer.connectors.pd.sidechannel import PeerUnreachable
from kvferry.kv_transfer.connectors.pd.tp_slices import (
    readers_per_source,
    remote_block_bytes,
    source_ranks,
)
from kvferry.kv_transfer.connectors.pd.transport import KVLayout
from kvferry.model.parallel import tp_rank, tp_size

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ReadFailed(RuntimeError):
    pass


class PeerClient:
    def __init__(
        self,
        ctx: zmq.Context,  # type: ignore[type-arg]
        codec: Codec,
        engine_id: str,
        agent_name: str,
        local: KVLayout,
        opts: PDOptions,
        label: str = "P/D",
        kv_layout: KVCacheLayout = KVCacheLayout.NHD,
        permute_local_kv: bool = False,
    ) -> None:
        self.codec = codec
        self.label = label
        self.engine_id = engine_id
        self.agent_name = agent_name
        self.local = local
        self.opts = opts
        # Our pool's order inside a block, and whether a peer of the other order is read
        # (received blocks permuted; kv_transfer_config's enable_permute_local_kv).
        self.kv_layout = kv_layout
        self.permute_local_kv = permute_local_kv
        self.rank, self.tp_size = tp_rank(), tp_size()
        # (a prefill engine's rank 0, a rank of it) -> that rank's side channel (loop thread)
        self._routes: dict[tuple[Addr, int], Addr] = {}
        actx = zmq.asyncio.Context.shadow(ctx.underlying)
        self._calls = PeerCalls(actx, codec, opts.handshake_timeout, label)  # loop thread only
        self._peers = PeerTable(opts.max_peer_inflight)  # loop thread only
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{label.lower()}-peers", daemon=True
        )
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------

    def prepare(
        self, spec: RecvSpec, source: int | None = None
    ) -> concurrent.futures.Future[tuple[AgentInfo, float]]:
        """Handshake (cached) and claim at rank ``source`` of the prefill engine (default:
        the first rank this rank reads) in the background; the future gives that rank's agent
        info and until when (our monotonic clock) it promised to hold the blocks, or raises
        ReadFailed."""
        if source is None:
            assert spec.remote is not None
            source = self.sources(spec.remote)[0]
        return self._submit(self._prepare(spec, source), ReadFailed("the engine is shutting down"))

    def forget(self, addr: Addr) -> None:
        """Handshake afresh next time (after a transport failure)."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._forget, addr)

    def renew(
        self, addr: Addr, request_ids: list[str], purpose: str, rank: int
    ) -> concurrent.futures.Future[Renewed | None]:
        """Heartbeat ``request_ids`` at rank ``rank`` of the engine whose rank 0 is at
        ``addr``; the future gives the peer's answer, or None (no answer, refused, or skipped:
        a heartbeat for ``purpose`` is still in flight)."""
        return self._submit(self._renew(addr, request_ids, purpose, rank), None)

    def sources(self, ref: RemoteRef) -> list[int]:
        """The ranks of ``ref``'s prefill engine that this rank reads from."""
        return source_ranks(self.rank, self.tp_size, ref.tp_size)

    def heartbeat(self, refs: list[RemoteRef]) -> None:
        """Renew the holds of requests waiting for admission (fire and forget)."""
        groups: dict[tuple[Addr, int], list[str]] = {}
        for ref in refs:
            for rank in self.sources(ref):
                groups.setdefault((addr_of(ref), rank), []).append(ref.request_id)
        for (addr, rank), ids in groups.items():
            self.renew(addr, ids, "waiting", rank)

    def release(
        self, ref: RemoteRef, block_ids: list[int]
    ) -> concurrent.futures.Future[str | None]:
        """Give back what the peer holds for ``ref``. The future resolves once the peer
        answered (None: released, or already gone) or the release was given up (why)."""
        req = ReleaseRequest(ref.engine_id, ref.request_id, block_ids, self.engine_id, ref.proof)
        coro = self._release_all(addr_of(ref), req, self.sources(ref))
        return self._submit(coro, "the engine is shutting down")

    def shutdown(self) -> None:
        """Wait up to handshake_timeout for the calls in flight, cancel the rest, stop."""
        if self._closed:
            return
        self._closed = True
        try:
            drain = asyncio.run_coroutine_threadsafe(self._drain(), self._loop)
            drain.result(self.opts.handshake_timeout + 5)
        except Exception as e:  # the loop is stopped below anyway
            logger.debug("%s: side-channel client shutdown: %r", self.label, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._calls.close_sockets()
            self._loop.close()

    def _submit(self, coro: Coroutine[Any, Any, T], closed: Any) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            if isinstance(closed, BaseException):
                fut.set_exception(closed)
            else:
                fut.set_result(closed)
            return fut
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop closed meanwhile (shutdown)
            coro.close()
            self._closed = True
            return self._submit(coro, closed)

    # -- loop thread -----------------------------------------------------------------------

    async def _drain(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.opts.handshake_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _forget(self, addr: Addr) -> None:
        self._peers.forget(addr)
        for key in [k for k in self._routes if k[0] == addr or self._routes[k] == addr]:
            self._peers.forget(self._routes.pop(key))

    async def _route(self, addr: Addr, rank: int) -> Addr:
        """Where calls for rank ``rank`` of the prefill engine whose rank 0 is at ``addr`` go."""
        if rank == 0:
            return addr
        routed = self._routes.get((addr, rank))
        if routed is not None:
            return routed
        host, port, engine_id = addr
        peer = self._peers.at(addr)
        try:
            reply = await self._calls.call(peer, HandshakeRequest(engine_id, rank))
        except Exception as e:
            failure = f"handshake with {host}:{port} for rank {rank} failed: {e}"
            peer.failed(failure)
            raise ReadFailed(failure) from None
        if not isinstance(reply, Redirect) or reply.rank != rank:
            why = reply.reason if isinstance(reply, Refused) else type(reply).__name__
            raise ReadFailed(f"engine {engine_id} at {host}:{port} has no rank {rank}: {why}")
        routed = (reply.host, reply.port, engine_id)
        self._routes[(addr, rank)] = routed
        return routed

    async def _prepare(self, spec: RecvSpec, source: int) -> tuple[AgentInfo, float]:
        remote = spec.remote
        assert remote is not None
        peer = self._peers.at(await self._route(addr_of(remote), source))
        for attempt in range(2):
            info = await self._agent_info(peer, source, remote.tp_size, refresh=attempt > 0)
            if max(spec.remote_block_ids) >= info.num_blocks:
                raise ReadFailed(
                    f"remote_block_ids name block {max(spec.remote_block_ids)} but engine "
                    f"{remote.engine_id} has only {info.num_blocks} blocks"
                )
            sent = time.monotonic()
            try:
                granted = await self._claim(peer, spec, remote.tp_size)
            except (PeerUnreachable, GivenUp) as e:
                peer.failed(f"claim failed: {e}")
                raise ReadFailed(f"claim failed: {e}") from None
            if granted.agent_name == info.agent_name:
                return info, sent + granted.expires_in
        raise ReadFailed(
            f"engine {remote.engine_id} changed its {self.label} agent during the claim"
        )

    async def _agent_info(
        self, peer: Peer, source: int, remote_tp: int, refresh: bool
    ) -> AgentInfo:
        async with peer.handshake:
            # Reads queued behind a failed handshake or an unanswered claim fail at once
            # instead of each waiting for the timeout.
            if peer.failed_within(self.opts.handshake_timeout):
                raise ReadFailed(peer.failure)
            if peer.info is not None and not refresh:
                return peer.info
            host, port, engine_id = peer.addr
            try:
                reply = await self._calls.call(peer, HandshakeRequest(engine_id, source))
                info = self._check_info(reply, engine_id, source, remote_tp)
            except Exception as e:
                failure = f"handshake with {host}:{port} failed: {e}"
                peer.failed(failure)
                raise ReadFailed(failure) from None
            peer.info = info
            return info

    def _check_info(
        self, reply: PeerReply, engine_id: str, source: int, remote_tp: int
    ) -> AgentInfo:
        if isinstance(reply, Refused):
            raise ProtocolError(f"refused: {reply.reason}")
        if not isinstance(reply, AgentInfo):
            raise ProtocolError(f"expected the peer's agent info, got {type(reply).__name__}")
        if reply.engine_id != engine_id:
            raise ProtocolError(
                f"the peer is engine {reply.engine_id!r}, but kv_transfer_params name "
                f"engine {engine_id!r}"
            )
        local = self.local
        # Rank ``source`` of a prefill engine of ``remote_tp`` ranks: H / remote_tp KV heads.
        block_bytes = remote_block_bytes(local.block_bytes, self.tp_size, remote_tp)
        expected = (local.block_size, local.num_layers, block_bytes, remote_tp, source)
        got = (
            reply.block_size,
            len(reply.base_addrs),
            reply.block_bytes,
            reply.tp_size,
            reply.rank,
        )
        if got != expected:
            raise ProtocolError(
                f"the peer's KV layout (block_size, layers, block_bytes, tp_size, rank) = {got} "
                f"does not match ours {expected}"
            )
        check_peer_layout(
            self.kv_layout,
            reply.kv_cache_layout,
            permute_local_kv=self.permute_local_kv,
        )
        return reply

    async def _claim(self, peer: Peer, spec: RecvSpec, remote_tp: int) -> Granted:
        remote = spec.remote
        assert remote is not None
        req = ClaimRequest(
            remote.engine_id,
            remote.request_id,
            spec.remote_block_ids,
            spec.num_tokens,
            spec.token_digest,
            self.engine_id,
            self.agent_name,
            remote.proof,
            readers_per_source(self.tp_size, remote_tp),
        )
        deadline = time.monotonic() + self.opts.handshake_timeout
        while True:
            left = deadline - time.monotonic()
            reply = await self._calls.call(peer, req, max(left, 0.05))
            if isinstance(reply, Granted):
                return reply
            if isinstance(reply, Refused) and reply.retry and left > 0.05:
                await asyncio.sleep(0.02)
                continue
            reason = reply.reason if isinstance(reply, Refused) else type(reply).__name__
            raise ReadFailed(f"engine {remote.engine_id} refused the read: {reason}")

    async def _renew(
        self, addr: Addr, request_ids: list[str], purpose: str, rank: int
    ) -> Renewed | None:
        try:
            addr = await self._route(addr, rank)
        except ReadFailed as e:
            logger.info("%s: heartbeat to %s:%d failed: %s", self.label, addr[0], addr[1], e)
            return None
        peer = self._peers.at(addr)
        if purpose in peer.beating:
            return None
        peer.beating.add(purpose)
        try:
            request = HeartbeatRequest(addr[2], request_ids, self.engine_id)
            reply = await self._calls.call(peer, request, droppable="heartbeats")
        except GivenUp:
            return None
        except Exception as e:
            logger.info("%s: heartbeat to %s failed: %s", self.label, peer.label, e)
            return None
        finally:
            peer.beating.discard(purpose)
        if isinstance(reply, Refused):
            logger.info("%s: heartbeat refused by %s: %s", self.label, peer.label, reply.reason)
        return reply if isinstance(reply, Renewed) else None

    async def _release_all(self, addr: Addr, req: ReleaseRequest, ranks: list[int]) -> str | None:
        """Release at every source rank; the first failure, if any."""
        answers = await asyncio.gather(*(self._release(addr, req, r) for r in ranks))
        return next((a for a in answers if a is not None), None)

    async def _release(self, addr: Addr, req: ReleaseRequest, rank: int) -> str | None:
        try:
            addr = await self._route(addr, rank)
        except ReadFailed as e:
            return str(e)
        peer = self._peers.at(addr)
        try:
            reply = await self._calls.call(peer, req, droppable="releases")
        except GivenUp as e:
            return str(e)
        except Exception as e:
            logger.info(
                "%s: release of %r at %s failed: %s", self.label, req.request_id, peer.label, e
            )
            return str(e)
        if isinstance(reply, Refused):
            logger.info("%s: release refused by %s: %s", self.label, peer.label, reply.reason)
            return reply.reason
        return None
