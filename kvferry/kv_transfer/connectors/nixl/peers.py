"""The decode side's side-channel client: handshakes, claims, heartbeats and releases.

Everything here runs on background threads (a small pool) and never touches the NIXL agent:
a handshake fetches and checks the prefill engine's agent info (engine id, KV layout, after
the compatibility hash), cached per engine; a claim asks the prefill engine to keep exactly
the named blocks for this reader and says for how long; heartbeats and releases are fire and
forget (logged when refused). Requests queued behind a failed handshake fail at once instead
of each waiting for the timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from kvferry.kv_transfer.connectors.nixl.agent import KVLayout
from kvferry.kv_transfer.connectors.nixl.handshake import (
    AgentInfo,
    ClaimRequest,
    Codec,
    Granted,
    HandshakeRequest,
    HeartbeatRequest,
    PeerReply,
    PeerRequest,
    PeerUnreachable,
    ProtocolError,
    Refused,
    ReleaseRequest,
    call,
)
from kvferry.kv_transfer.connectors.nixl.metadata import NixlOptions, RecvSpec, RemoteRef

logger = logging.getLogger(__name__)


class ReadFailed(RuntimeError):
    pass


@dataclass
class _EngineState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    info: AgentInfo | None = None
    failed_at: float = -1e9
    failure: str = ""


class PeerClient:
    def __init__(
        self,
        ctx: zmq.Context,  # type: ignore[type-arg]
        codec: Codec,
        engine_id: str,
        agent_name: str,
        local: KVLayout,
        opts: NixlOptions,
    ) -> None:
        self.ctx = ctx
        self.codec = codec
        self.engine_id = engine_id
        self.agent_name = agent_name
        self.local = local
        self.opts = opts
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nixl-peers")
        self._engines: dict[str, _EngineState] = {}
        self._engines_lock = threading.Lock()

    def prepare(self, spec: RecvSpec) -> Future[tuple[AgentInfo, float]]:
        """Handshake (cached) and claim in the background; the future gives the peer's agent
        info and until when (our monotonic clock) it promised to hold the blocks."""
        return self._pool.submit(self._prepare, spec)

    def forget(self, engine_id: str) -> None:
        """Handshake afresh next time (after a transport failure)."""
        self._engine(engine_id).info = None  # no lock: a handshake may be holding it

    def heartbeat(self, refs: list[RemoteRef]) -> None:
        groups: dict[tuple[str, str, int], list[str]] = {}
        for ref in refs:
            groups.setdefault((ref.engine_id, ref.host, ref.port), []).append(ref.request_id)
        for (eid, host, port), ids in groups.items():
            self._fire(host, port, HeartbeatRequest(eid, ids, self.engine_id))

    def release(self, ref: RemoteRef, block_ids: list[int]) -> None:
        req = ReleaseRequest(ref.engine_id, ref.request_id, block_ids, self.engine_id)
        self._fire(ref.host, ref.port, req)

    def shutdown(self) -> None:
        """Wait for the calls in flight (each bounded by handshake_timeout)."""
        self._pool.shutdown(wait=True)

    def _engine(self, engine_id: str) -> _EngineState:
        with self._engines_lock:
            return self._engines.setdefault(engine_id, _EngineState())

    def _prepare(self, spec: RecvSpec) -> tuple[AgentInfo, float]:
        """Handshake (cached) and claim; returns the peer and until when it holds the blocks."""
        remote = spec.remote
        assert remote is not None
        for attempt in range(2):
            info = self._agent_info(remote, refresh=attempt > 0)
            if max(spec.remote_block_ids) >= info.num_blocks:
                raise ReadFailed(
                    f"remote_block_ids name block {max(spec.remote_block_ids)} but engine "
                    f"{remote.engine_id} has only {info.num_blocks} blocks"
                )
            sent = time.monotonic()
            try:
                granted = self._claim(remote, spec)
            except PeerUnreachable as e:
                self._failed(remote, f"claim failed: {e}")
                raise ReadFailed(f"claim failed: {e}") from None
            if granted.agent_name == info.agent_name:
                return info, sent + granted.expires_in
        raise ReadFailed(f"engine {remote.engine_id} changed its NIXL agent during the claim")

    def _agent_info(self, remote: RemoteRef, refresh: bool) -> AgentInfo:
        state = self._engine(remote.engine_id)
        with state.lock:
            # Requests queued behind a failed handshake or an unanswered claim fail at once
            # instead of each waiting for the timeout.
            if time.monotonic() - state.failed_at < self.opts.handshake_timeout:
                raise ReadFailed(state.failure)
            if state.info is not None and not refresh:
                return state.info
            try:
                reply = self.call(remote.host, remote.port, HandshakeRequest(remote.engine_id, 0))
                info = self._check_info(reply, remote)
            except Exception as e:
                failure = f"handshake with {remote.host}:{remote.port} failed: {e}"
                state.failed_at, state.failure, state.info = time.monotonic(), failure, None
                raise ReadFailed(failure) from None
            state.info = info
            return info

    def _failed(self, remote: RemoteRef, failure: str) -> None:
        state = self._engine(remote.engine_id)
        state.failed_at, state.failure, state.info = time.monotonic(), failure, None

    def _check_info(self, reply: PeerReply, remote: RemoteRef) -> AgentInfo:
        if isinstance(reply, Refused):
            raise ProtocolError(f"refused: {reply.reason}")
        if not isinstance(reply, AgentInfo):
            raise ProtocolError(f"expected the peer's agent info, got {type(reply).__name__}")
        if reply.engine_id != remote.engine_id:
            raise ProtocolError(
                f"the peer is engine {reply.engine_id!r}, but kv_transfer_params name "
                f"engine {remote.engine_id!r}"
            )
        local = self.local
        expected = (local.block_size, local.num_layers, local.block_bytes, 1, 0)
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
        return reply

    def _claim(self, remote: RemoteRef, spec: RecvSpec) -> Granted:
        req = ClaimRequest(
            remote.engine_id,
            remote.request_id,
            spec.remote_block_ids,
            spec.num_tokens,
            spec.token_digest,
            self.engine_id,
            self.agent_name,
        )
        deadline = time.monotonic() + self.opts.handshake_timeout
        while True:
            left = deadline - time.monotonic()
            reply = self.call(remote.host, remote.port, req, max(left, 0.05))
            if isinstance(reply, Granted):
                return reply
            if isinstance(reply, Refused) and reply.retry and left > 0.05:
                time.sleep(0.02)
                continue
            reason = reply.reason if isinstance(reply, Refused) else type(reply).__name__
            raise ReadFailed(f"engine {remote.engine_id} refused the read: {reason}")

    def call(
        self, host: str, port: int, request: PeerRequest, timeout: float | None = None
    ) -> PeerReply:
        return call(
            self.ctx, host, port, self.codec, request, timeout or self.opts.handshake_timeout
        )

    def _fire(self, host: str, port: int, request: PeerRequest) -> None:
        def send() -> None:
            try:
                reply = self.call(host, port, request)
            except Exception as e:
                logger.info("NIXL: %s to %s:%d failed: %s", type(request).__name__, host, port, e)
                return
            if isinstance(reply, Refused):
                logger.info(
                    "NIXL: %s refused by %s:%d: %s",
                    type(request).__name__,
                    host,
                    port,
                    reply.reason,
                )

        try:
            self._pool.submit(send)
        except RuntimeError:  # shut down
            logger.debug("NIXL: %s not sent: shutting down", type(request).__name__)
