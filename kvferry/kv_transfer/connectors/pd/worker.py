"""The worker side of a P/D connector: one transport and one side channel per worker.

A family (NIXL, Mooncake) subclasses :class:`PDConnectorWorker` to build its
:class:`~.transport.KVTransport`; everything else is shared.

As a **prefill** instance it registers its KV pool with the transport, answers handshakes, claims,
heartbeats and releases on the side channel (:mod:`.handshake`, :mod:`.lease`), and reports a
held request ``finished_sending`` when its reader's READ-completion notification arrives, when
the decode side releases it, or when its lease runs out.

As a **decode** instance it reads prompts' KV from prefill instances (:mod:`.reader`) and
reports each read ``finished_recving``; failed ones also in ``get_failed_recving`` so the
scheduler applies ``kv_load_failure_policy``.

The same instance plays both parts for different requests when asked to.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import zmq

from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorStats
from kvferry.kv_transfer.connectors.pd.auth import load_peer_auth
from kvferry.kv_transfer.connectors.pd.handshake import (
    AgentInfo,
    ClaimRequest,
    Codec,
    Compat,
    HandshakeRequest,
    HeartbeatRequest,
    PeerReply,
    PeerRequest,
    ProtocolError,
    Redirect,
    Refused,
    ReleaseRequest,
    SideChannelServer,
)
from kvferry.kv_transfer.connectors.pd.layout_match import BlockPermuter
from kvferry.kv_transfer.connectors.pd.lease import LeaseTable
from kvferry.kv_transfer.connectors.pd.metadata import (
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PDWorkerMeta,
)
from kvferry.kv_transfer.connectors.pd.options import PDOptions, side_channel_address
from kvferry.kv_transfer.connectors.pd.reader import Reader
from kvferry.kv_transfer.connectors.pd.transport import KVTransport
from kvferry.kv_transfer.connectors.split import WorkerHalf
from kvferry.model.parallel import all_gather_object, tp_rank, tp_size

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.model.forward_context import ForwardContext

logger = logging.getLogger(__name__)

# Sleep on a step without tokens while transfers are pending, so an idle engine that only
# waits for completions does not spin a core.
_IDLE_WAIT_READING_S = 0.0005
_IDLE_WAIT_HOLDING_S = 0.005
# Stats keys by how a hold ended (the first word of LeaseTable's reason).
_ENDED_STATS = {"read": "sends", "released": "released_unread", "lease": "expired_leases"}


class PDConnectorWorker(WorkerHalf):
    """The shared worker half; a subclass says which transport moves the bytes."""

    # Prefix of this connector's stats keys ("nixl" -> nixl_reads, nixl_read_bytes, ...).
    stats_prefix = "pd"
    # Named in the compatibility description, so families never pair (None: NIXL's).
    compat_transport: str | None = None

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        opts: PDOptions,
        engine_id: str,
        rank: int | None = None,
    ) -> None:
        self.opts = opts
        self.engine_id = engine_id
        # Under tensor parallelism each rank serves (and reads) its own KV heads.
        self.rank = tp_rank() if rank is None else rank
        self.tp_size = tp_size()
        rank = self.rank
        # Every rank's side channel, in rank order (set once all ranks have bound theirs).
        self.rank_addrs: list[tuple[str, int]] = []
        compat = Compat.of(config, kv_cache_config, self.compat_transport)
        self.kv_layout = kv_cache_config.layout
        kvt = config.kv_transfer_config
        self.permute_local_kv = kvt is not None and kvt.enable_permute_local_kv
        self.codec = Codec(compat, load_peer_auth(opts))
        self.host, self.port = side_channel_address(config, opts, rank)
        self.agent_name = f"{engine_id}-r{rank}-{uuid.uuid4().hex[:8]}"
        self.transport: KVTransport = self.make_transport(self.agent_name)
        self.label = self.transport.label
        self.ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
        self.leases = LeaseTable(
            engine_id,
            self.agent_name,
            opts.kv_lease_duration,
            opts.kv_lease_max_duration,
            label=self.label,
        )
        self.stats: dict[str, float] = defaultdict(float)
        self._info: AgentInfo | None = None
        self._server: SideChannelServer | None = None
        self._reader: Reader | None = None
        self._failed: set[str] = set()
        self._released: set[str] = set()  # decode requests whose release was answered
        self._released_lock = threading.Lock()
        self._empty_step = False

    # -- setup -----------------------------------------------------------------------------

    def make_transport(self, name: str) -> KVTransport:
        """The transport of this worker, named ``name`` (its side channel is ``self.host``)."""
        raise NotImplementedError

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self.transport.register(kv_caches)
        share = self.opts.max_reader_share
        self.leases.max_reader_blocks = None if share >= 1 else math.ceil(share * layout.num_blocks)
        self._info = AgentInfo(
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            agent_metadata=self.transport.metadata(),
            rank=self.rank,
            tp_size=self.tp_size,
            block_size=layout.block_size,
            num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            mem_type=layout.mem_type,  # type: ignore[arg-type]
            device_id=layout.device_id,
            base_addrs=list(layout.base_addrs),
            kv_cache_layout=self.kv_layout.value,  # type: ignore[arg-type]
        )
        self._server = SideChannelServer(
            self.ctx, self.host, self.port, self.codec, self._answer, self.label
        )
        self.port = self._server.port
        # A reader's rank r finds rank r here through rank 0 (whose address the params name).
        # Every rank registers its caches at start-up in the same order, so this collective
        # is met by all of them.
        gathered = all_gather_object((self.host, self.port))
        self.rank_addrs = [(str(a[0]), int(a[1])) for a in gathered]  # type: ignore[index]
        self._reader = Reader(
            self.transport,
            layout,
            self.codec,
            self.ctx,
            self.engine_id,
            self.opts,
            self.stats,
            self.label,
            kv_layout=self.kv_layout,
            permuter=BlockPermuter(kv_caches, self.kv_layout) if self.permute_local_kv else None,
        )
        logger.info(
            "%s connector ready: engine=%s agent=%s side_channel=%s:%d memory=%s blocks=%d %s",
            self.label,
            self.engine_id,
            self.agent_name,
            self.host,
            self.port,
            layout.mem_type,
            layout.num_blocks,
            self.transport.describe(),
        )

    @property
    def reader(self) -> Reader:
        if self._reader is None:
            raise RuntimeError(f"{self.label} connector: register_kv_caches was not called")
        return self._reader

    # -- side channel (server thread) ------------------------------------------------------

    def _answer(self, request: PeerRequest, peer: str) -> PeerReply:
        if isinstance(request, HandshakeRequest):
            if request.engine_id != self.engine_id:
                return Refused(f"this is engine {self.engine_id}, not {request.engine_id}")
            if self._info is None or request.rank >= max(1, len(self.rank_addrs)):
                return Refused(f"no worker rank {request.rank} here")
            if request.rank != self.rank:
                host, port = self.rank_addrs[request.rank]
                return Redirect(request.rank, host, port)
            return self._info
        if isinstance(request, ClaimRequest):
            return self.leases.claim(request, peer)
        if isinstance(request, HeartbeatRequest):
            return self.leases.heartbeat(
                request.engine_id, request.request_ids, request.reader_engine_id, peer
            )
        if isinstance(request, ReleaseRequest):
            return self.leases.release(request)
        raise ProtocolError(f"unexpected {type(request).__name__}")

    # -- per step (engine thread) ----------------------------------------------------------

    def bind(self, meta: PDConnectorMetadata) -> None:
        """Before the forward: register new holds so claims racing this step find them."""
        if meta.expected_sends:
            self.leases.expect(meta.expected_sends)
        for spec in meta.reqs_to_send:
            self.leases.add(spec.req_id, spec.block_ids, spec.num_tokens, spec.token_digest)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, PDConnectorMetadata)
        self.bind(metadata)

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: ForwardContext) -> None:
        assert isinstance(metadata, PDConnectorMetadata)
        self.start_load(metadata, empty_step=forward_context.attn_metadata is None)

    def start_load(self, meta: PDConnectorMetadata, empty_step: bool) -> None:
        self._empty_step = empty_step
        reader = self.reader
        for spec in meta.reqs_to_recv:
            reader.start(spec)
        for rel in meta.releases:
            answer = reader.release(rel.remote, rel.block_ids)
            if rel.req_id is not None:
                answer.add_done_callback(functools.partial(self._release_done, rel.req_id))
        if meta.heartbeats:
            reader.heartbeat(meta.heartbeats)

    def _release_done(self, req_id: str, _: object) -> None:
        with self._released_lock:
            self._released.add(req_id)

    def get_finished(
        self,
        finished_req_ids: set[str] | None = None,
        metadata: KVConnectorMetadata | None = None,
    ) -> tuple[set[str], set[str]]:
        reader = self.reader
        # Answered releases first: a release of a hold here ended it before its answer was
        # sent, so both reach the scheduler in this same step.
        with self._released_lock:
            released, self._released = self._released, set()
        self._drain_notifs()
        reader.poll()
        self.leases.reap()
        ended = self.leases.take_finished()
        for reason in ended.values():
            kind = reason.split(" ", 1)[0]  # "read", "released", "lease", "engine"
            self.stats[_ENDED_STATS.get(kind, "holds_dropped")] += 1
        sending = set(ended) | released
        recving, self._failed = reader.take()
        if self._empty_step and not (sending or recving):
            if reader.busy():
                time.sleep(_IDLE_WAIT_READING_S)
            elif self.leases.num_held():
                time.sleep(_IDLE_WAIT_HOLDING_S)
        return sending, recving

    def get_failed_recving(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def _drain_notifs(self) -> None:
        for agent, messages in self.transport.notifs().items():
            for data in messages:
                try:
                    note = self.codec.decode_notif(bytes(data))
                except ProtocolError as e:
                    self.stats["bad_notifs"] += 1
                    logger.warning(
                        "%s: ignoring a notification from agent %r: %s", self.label, agent, e
                    )
                    continue
                if note.engine_id != self.engine_id or not self.leases.complete(
                    note.request_id, note.reader_engine_id, str(agent)
                ):
                    # Typically the lease ran out before the read completed.
                    self.stats["late_notifs"] += 1
                    logger.info(
                        "%s: read-completion of %r from engine %s matches no hold here",
                        self.label,
                        note.request_id,
                        note.reader_engine_id,
                    )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.take_stats()

    def take_stats(self) -> KVConnectorStats | None:
        data = {k: v for k, v in self.stats.items() if v}
        self.stats.clear()
        prefix = self.stats_prefix
        return KVConnectorStats({f"{prefix}_{k}": v for k, v in data.items()}) if data else None

    def build_connector_worker_meta(self) -> PDWorkerMeta:
        return self.worker_meta()

    def get_handshake_metadata(self) -> PDHandshakeMetadata:
        return self.handshake_metadata()

    def worker_meta(self) -> PDWorkerMeta:
        return PDWorkerMeta({self.rank: (self.host, self.port)})

    def handshake_metadata(self) -> PDHandshakeMetadata:
        return PDHandshakeMetadata(self.engine_id, self.rank, self.host, self.port, self.agent_name)

    def has_pending(self) -> bool:
        return bool(self._reader is not None and self._reader.busy()) or self.leases.num_held() > 0

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._reader is not None:
            self._reader.shutdown()
        held = self.leases.drop_all()
        if held:
            logger.info("%s: shutting down with %d held requests", self.label, len(held))
        self.transport.close()
        self.ctx.term()
