"""The decode side's reads: claim, READ, completion, failure.

Per request the side-channel client (:mod:`.peers`, background threads) handshakes with the
prefill engine and claims the request's blocks; the engine thread then loads the peer's transport
metadata (once per agent) and posts a non-blocking READ whose completion notification tells
the prefill side it may free the blocks. Each step :meth:`Reader.poll` advances this; whatever
fails (handshake, claim, transfer error, timeout, peer gone) ends the read as *failed*, so the
scheduler applies ``kv_load_failure_policy``. A failed read's claim is given back so the
prefill instance frees its blocks at once rather than at lease expiry.

Reads in flight are heartbeated from a timer thread (independent of the engine thread; the
heartbeats to each peer run on their own, so a dead peer delays no other), and a completed
READ is trusted only if the prefill side provably still held the blocks: its last answer
(claim or heartbeat) promised the hold past the moment the READ was seen complete, or it
reported the hold ended *because this read completed*. Otherwise the lease may have run
out mid-read and the blocks been reused, so the read counts as failed rather than decode on
someone else's KV.

Loaded transport peers are kept per agent name, each prefill address mapping to the agent it
announced; an agent announced again with other metadata or another layout is refused, so a
forged address cannot swap the peer a legitimate read uses.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from kvferry.kv_layout import KVCacheLayout
from kvferry.kv_transfer.connectors.pd.handshake import (
    AgentInfo,
    Codec,
    ProtocolError,
    ReadDone,
    Renewed,
)
from kvferry.kv_transfer.connectors.pd.layout_match import BlockPermuter
from kvferry.kv_transfer.connectors.pd.metadata import RecvSpec, RemoteRef
from kvferry.kv_transfer.connectors.pd.options import PDOptions
from kvferry.kv_transfer.connectors.pd.peers import Addr, PeerClient, addr_of
from kvferry.kv_transfer.connectors.pd.tp_slices import head_slice, pieces
from kvferry.kv_transfer.connectors.pd.transport import (
    DONE,
    PROC,
    KVLayout,
    KVTransport,
    RemotePeer,
)

logger = logging.getLogger(__name__)

Key = tuple[Addr, int]  # a prefill engine (its rank 0's address) and one of its ranks


@dataclass
class _Leg:
    """The part of a read from one prefill rank (several across TP sizes, see
    :mod:`.tp_slices`)."""

    source: int  # the prefill rank read
    prep: Future[tuple[AgentInfo, float]]
    handle: Any = None
    peer: RemotePeer | None = None
    posted: float = 0.0
    done: bool = False  # READ complete (and trusted)
    # The prefill rank holds the blocks at least until then (our clock); guarded by _lock.
    held_until: float = 0.0
    freed_after_read: bool = False


@dataclass
class _Read:
    spec: RecvSpec
    legs: list[_Leg]
    permute: bool = False  # the prefill pool has the other layout: rewrite what arrives

    def handles(self) -> list[Any]:
        return [leg.handle for leg in self.legs if leg.handle is not None]


class Reader:
    def __init__(
        self,
        transport: KVTransport,
        local: KVLayout,
        codec: Codec,
        ctx: zmq.Context,  # type: ignore[type-arg]
        engine_id: str,
        opts: PDOptions,
        stats: dict[str, float],
        label: str = "P/D",
        kv_layout: KVCacheLayout = KVCacheLayout.NHD,
        permuter: BlockPermuter | None = None,
    ) -> None:
        """``permuter``: given when a prefill pool of the other layout may be read
        (``enable_permute_local_kv``); without one such a peer's handshake fails."""
        self.transport = transport
        self.local = local
        self.kv_layout = kv_layout
        self.permuter = permuter
        self.codec = codec
        self.ctx = ctx
        self.engine_id = engine_id
        self.opts = opts
        self.stats = stats
        self.label = label  # the transport family, for logs and errors
        self.peers = PeerClient(
            ctx,
            codec,
            engine_id,
            transport.name,
            local,
            opts,
            label,
            kv_layout=kv_layout,
            permute_local_kv=permuter is not None,
        )
        self._reads: dict[str, _Read] = {}
        self._agents: dict[str, tuple[RemotePeer, AgentInfo]] = {}  # agent name -> loaded
        self._addr_agent: dict[Key, str] = {}  # prefill address and rank -> its agent
        self._retired: list[RemotePeer] = []
        self._stuck: list[Any] = []  # handles the transport would not release yet
        # Failed reads whose READs could not be cancelled yet: (read, why, deadline, handles).
        self._draining: dict[str, tuple[_Read, str, float, list[Any]]] = {}
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._lock = threading.Lock()  # _reads membership and the legs' held_until fields
        self._stop = threading.Event()
        self._beater = threading.Thread(
            target=self._beat, name=f"{label.lower()}-heartbeat", daemon=True
        )
        self._beater.start()

    # -- engine thread ---------------------------------------------------------------------

    def start(self, spec: RecvSpec) -> None:
        if spec.error is not None or spec.remote is None:
            self._fail_now(spec.req_id, spec.error or "no remote named")
            return
        legs = [_Leg(s, self.peers.prepare(spec, s)) for s in self.peers.sources(spec.remote)]
        with self._lock:
            self._reads[spec.req_id] = _Read(spec, legs)

    def poll(self) -> None:
        now = time.monotonic()
        for req_id, rd in list(self._reads.items()):
            error, transport_error = None, False
            for leg in rd.legs:
                error, transport_error = self._advance(rd, leg, now)
                if error is not None:
                    break
            if error is not None:
                # One failed part fails the whole request (kv_load_failure_policy applies).
                self._finish(req_id, rd, error, transport_error)
            elif all(leg.done for leg in rd.legs):
                self._finish(req_id, rd, None)
        self._drain(now)
        self._drop_retired()

    def _advance(self, rd: _Read, leg: _Leg, now: float) -> tuple[str | None, bool]:
        """Move one leg on; (why it failed, whether the transport failed) or (None, False)."""
        if leg.done:
            return None, False
        if leg.handle is None:
            if not leg.prep.done():
                return None, False
            if (exc := leg.prep.exception()) is not None:
                return str(exc), False
        try:
            if leg.handle is None:
                info, held_until = leg.prep.result()
                with self._lock:
                    leg.held_until = max(leg.held_until, held_until)
                self._post(rd, leg, info)
            state = self.transport.state(leg.handle)
        except Exception as e:
            return f"{self.label} transfer error (is the prefill instance gone?): {e!r}", True
        if state == DONE:
            untrusted = self._untrusted(leg, time.monotonic())
            leg.done = untrusted is None
            return untrusted, False
        if state != PROC:
            return f"{self.label} reports the READ failed", True
        if now - leg.posted > self.opts.transfer_timeout:
            return f"READ still running after {self.opts.transfer_timeout}s", False
        return None, False

    def _untrusted(self, leg: _Leg, now: float) -> str | None:
        with self._lock:
            if leg.freed_after_read or now < leg.held_until:
                return None
        return (
            "the READ completed after the prefill side's last confirmed hold on the blocks "
            "ended (its lease may have run out mid-read); the data is not used"
        )

    def take(self) -> tuple[set[str], set[str]]:
        """Reads ended since the last call: (all of them, the failed ones)."""
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        return done, failed

    def peer(self, engine_id: str) -> RemotePeer | None:
        """The loaded transport peer of a prefill engine, once a read from it was posted."""
        return next((p for p, i in self._agents.values() if i.engine_id == engine_id), None)

    def busy(self) -> bool:
        return bool(self._reads or self._draining)

    def heartbeat(self, refs: list[RemoteRef]) -> None:
        self.peers.heartbeat(refs)

    def release(self, ref: RemoteRef, block_ids: list[int]) -> Future[str | None]:
        """See :meth:`PeerClient.release`."""
        return self.peers.release(ref, block_ids)

    def shutdown(self) -> None:
        """Cancel what has not started, give back granted claims, wait for the side-channel
        calls in flight (each bounded by handshake_timeout), unload the peers."""
        self._stop.set()
        for rd in self._reads.values():
            for leg in rd.legs:
                leg.prep.cancel()
        for req_id, rd in list(self._reads.items()):
            self._finish(req_id, rd, "engine shut down")
        self.peers.shutdown()
        self._beater.join(timeout=self.opts.handshake_timeout + 1)
        for peer in [*(p for p, _ in self._agents.values()), *self._retired]:
            self.transport.remove_peer(peer)
        self._agents.clear()
        self._addr_agent.clear()
        self._retired.clear()

    def _post(self, rd: _Read, leg: _Leg, info: AgentInfo) -> None:
        spec, remote = rd.spec, rd.spec.remote
        assert remote is not None
        leg.peer = peer = self._load((addr_of(remote), leg.source), info)
        # The handshake admitted a peer of the other layout only with a permuter.
        rd.permute = rd.permute or info.kv_cache_layout != self.kv_layout.value
        notif = self.codec.encode_notif(
            ReadDone(remote.engine_id, remote.request_id, self.engine_id)
        )
        leg.posted = time.monotonic()
        remote_ids = spec.remote_ids_to_read()
        rank, tp = self.peers.rank, self.peers.tp_size
        if remote.tp_size == tp:
            leg.handle, _ = self.transport.read(peer, spec.local_block_ids, remote_ids, notif)
            return
        # Head slices land in the peer's order; with the other layout the blocks are
        # permuted once every leg is in (_report), as whole-block reads are.
        sl = head_slice(rank, tp, leg.source, remote.tp_size, self.local, peer.layout)
        local, far, n = pieces(self.local, peer.layout, spec.local_block_ids, remote_ids, sl)
        leg.handle, _ = self.transport.read_pieces(peer, local, far, n, notif)

    def _finish(
        self, req_id: str, rd: _Read, error: str | None, transport_error: bool = False
    ) -> None:
        with self._lock:
            del self._reads[req_id]
        remote = rd.spec.remote
        assert remote is not None
        if transport_error:
            self._forget(addr_of(remote))
        stuck = [h for h in rd.handles() if not self.transport.release(h)]
        if stuck:
            if error is not None:
                # The transport could not cancel a READ, which may still write into the
                # request's blocks: report it (and so let the blocks go) only once the handles
                # are released, or after another transfer_timeout at the latest.
                deadline = time.monotonic() + self.opts.transfer_timeout
                self._draining[req_id] = (rd, error, deadline, stuck)
                return
            self._stuck.extend(stuck)
        self._report(req_id, rd, error, released=True)

    def _drain(self, now: float) -> None:
        for req_id, (rd, error, deadline, handles) in list(self._draining.items()):
            stuck = [h for h in handles if not self.transport.release(h)]
            if not stuck or now >= deadline:
                del self._draining[req_id]
                if stuck:
                    logger.error(
                        "%s: READ of %s cannot be cancelled; freeing anyway", self.label, req_id
                    )
                    self._stuck.extend(stuck)
                self._report(req_id, rd, error, released=not stuck)
            else:
                self._draining[req_id] = (rd, error, deadline, stuck)
        self._stuck = [h for h in self._stuck if not self.transport.release(h)]

    def _report(self, req_id: str, rd: _Read, error: str | None, released: bool) -> None:
        remote = rd.spec.remote
        assert remote is not None
        if error is None and rd.permute:
            assert self.permuter is not None
            try:
                self.permuter.to_local(rd.spec.local_block_ids)
            except Exception as e:  # e.g. out of device memory: the blocks are not usable
                error = f"permuting the received blocks into {self.kv_layout.value} failed: {e!r}"
        self._done.add(req_id)
        if error is None:
            nbytes = 2 * len(rd.spec.local_block_ids) * self.local.block_bytes
            self.stats["reads"] += 1
            self.stats["read_bytes"] += nbytes * self.local.num_layers
            self.stats["read_seconds"] += time.monotonic() - min(g.posted for g in rd.legs)
            return
        self._failed.add(req_id)
        self.stats["failed_reads"] += 1
        logger.warning(
            "%s: loading the KV of request %s from engine %s at %s:%d failed: %s "
            "(kv_load_failure_policy applies)",
            self.label,
            req_id,
            remote.engine_id,
            remote.host,
            remote.port,
            error,
        )
        prep_ok = any(
            g.prep.done() and not g.prep.cancelled() and g.prep.exception() is None for g in rd.legs
        )
        if prep_ok and released:
            # Claimed but not read: give the blocks back now instead of at lease expiry.
            self.release(remote, rd.spec.remote_block_ids)

    def _fail_now(self, req_id: str, reason: str) -> None:
        logger.warning("%s: request %s cannot load remote KV: %s", self.label, req_id, reason)
        self.stats["failed_reads"] += 1
        self._done.add(req_id)
        self._failed.add(req_id)

    def _load(self, key: Key, info: AgentInfo) -> RemotePeer:
        """The transport peer of the agent ``info`` announces for ``key`` (the prefill engine's
        address and rank), loaded once per agent."""
        name = info.agent_name
        loaded = self._agents.get(name)
        if loaded is not None and loaded[1] != info:
            raise ProtocolError(
                f"{self.label} agent {name!r} was announced before with other metadata or layout"
            )
        if loaded is None:
            loaded = self._agents[name] = (self.transport.add_peer(info), info)
        old = self._addr_agent.get(key)
        self._addr_agent[key] = name
        if old is not None and old != name:
            self._retire_unused(old)  # that prefill instance restarted
        return loaded[0]

    def _retire_unused(self, name: str) -> None:
        if name not in self._addr_agent.values() and name in self._agents:
            self._retired.append(self._agents.pop(name)[0])

    def _forget(self, addr: Addr) -> None:
        """After a transport failure: handshake afresh next time, unload the agents when idle."""
        self.peers.forget(addr)
        names = {n for k, n in self._addr_agent.items() if k[0] == addr}
        # The agents themselves failed: every address announcing them handshakes afresh.
        for key in [k for k, n in self._addr_agent.items() if n in names]:
            del self._addr_agent[key]
            self.peers.forget(key[0])
        for name in names:
            self._retire_unused(name)

    def _drop_retired(self) -> None:
        reads = [*self._reads.values(), *(d[0] for d in self._draining.values())]
        in_use = {id(g.peer) for r in reads for g in r.legs if g.handle is not None}
        keep = []
        for peer in self._retired:
            if id(peer) in in_use:
                keep.append(peer)
            else:
                self.transport.remove_peer(peer)
        self._retired = keep

    # -- background threads ----------------------------------------------------------------

    def _beat(self) -> None:
        """Heartbeat the reads in flight, and record how long each is confirmed held."""
        period = self.opts.heartbeat_s
        while not self._stop.wait(period):
            groups: dict[Key, dict[str, _Leg]] = {}
            with self._lock:
                for rd in self._reads.values():
                    ref = rd.spec.remote
                    if ref is None:
                        continue
                    for leg in rd.legs:
                        if leg.prep.done() and not leg.done:
                            groups.setdefault((addr_of(ref), leg.source), {})[ref.request_id] = leg
            for (addr, source), legs in groups.items():
                sent = time.monotonic()
                answer = self.peers.renew(addr, list(legs), "reads", source)
                answer.add_done_callback(functools.partial(self._renewed, legs, sent))

    def _renewed(self, reads: dict[str, _Leg], sent: float, answer: Future[Renewed | None]) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return
        reply = answer.result()
        if reply is None:
            return
        with self._lock:
            for req_id, left in reply.held.items():
                if req_id in reads:
                    leg = reads[req_id]
                    leg.held_until = max(leg.held_until, sent + left)
            for req_id in reply.read:
                if req_id in reads:
                    reads[req_id].freed_after_read = True
