"""The scheduler side of a P/D connector (NIXL, Mooncake): plans reads and holds, touches
no tensor.

Decode side (``do_remote_prefill``): the whole prompt beyond the local prefix hit is an
asynchronous external hit; after allocation the remote blocks are mapped onto the newly
allocated local ones, the request's params are switched to ``do_remote_prefill: false`` (one
transfer per request, also after preemption), and the read goes to the workers. Requests
waiting for admission get heartbeats so the prefill side keeps their blocks. A decode request
that ends before it was admitted releases the prefill side's blocks.

Prefill side (``do_remote_decode``): a request that finished normally keeps its prompt's
blocks (delayed free) and returns the params a decode instance reads them with; requests that
were aborted or failed free theirs at once. The side-channel address in those params is the
configured one, or (port 0) the one the workers report.

Params are untrusted: invalid ones make the request's load fail with a clear message (so the
scheduler applies ``kv_load_failure_policy``) and nothing is held anywhere. With a deployment
secret the params this instance issues are signed, and it reads (or releases) only with params
whose signature verifies; :meth:`PDConnectorScheduler.validate` refuses others at intake.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.connectors.pd.metadata import (
    PDConnectorMetadata,
    PDHandshakeMetadata,
    PDWorkerMeta,
    RecvSpec,
    ReleaseSpec,
    RemoteRef,
    SendSpec,
)
from kvferry.kv_transfer.connectors.pd.options import PDOptions, side_channel_address
from kvferry.kv_transfer.connectors.pd.params import (
    ParamsError,
    RemoteParams,
    Side,
    check_prompt,
    check_signature,
    decode_params,
    first_sent_block,
    parse_remote,
    request_side,
    token_digest,
)
from kvferry.kv_transfer.connectors.split import SchedulerHalf
from kvferry.request import RequestStatus

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.base import KVConnectorHandshakeMetadata
    from kvferry.kv_transfer.connectors.pd.auth import PeerAuth
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
    from kvferry.request import Request
    from kvferry.step_types.kv_connector_output import KVConnectorOutput
    from kvferry.step_types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_HOLD_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def _ref(remote: RemoteParams) -> RemoteRef:
    return RemoteRef(
        remote.remote_engine_id,
        remote.remote_host,
        remote.remote_port,
        remote.remote_request_id,
        remote.proof(),
        remote.tp_size,
    )


class PDConnectorScheduler(SchedulerHalf):
    # The transport family, for logs.
    label = "P/D"

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        opts: PDOptions,
        engine_id: str,
        auth: PeerAuth | None = None,
    ) -> None:
        self.opts = opts
        self.engine_id = engine_id
        self.signer = auth.params if auth is not None else None
        self.block_size = kv_cache_config.block_size
        # Per KV cache group its sliding window (None: full attention); one entry but for
        # hybrid engines, whose null block never travels.
        self.windows = tuple(g.sliding_window for g in kv_cache_config.groups)
        self.null_block = kv_cache_config.null_block_id
        parallel = getattr(config, "parallel_config", None)  # tests may pass a partial config
        self.tp_size = int(getattr(parallel, "tensor_parallel_size", 1))
        host, port = side_channel_address(config, opts, rank=0)
        self.address: tuple[str, int] | None = (host, port) if port else None
        self._remote: dict[str, RemoteParams | ParamsError] = {}
        self._waiting: dict[str, RemoteRef] = {}  # looked up, not admitted: heartbeat them
        self._consumed: set[str] = set()  # decode requests whose one transfer was planned
        self._recv: list[RecvSpec] = []
        self._send: list[SendSpec] = []
        self._expected: list[str] = []
        self._releases: list[ReleaseSpec] = []
        self._next_heartbeat = 0.0

    # -- where our side channel is ---------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.set_handshake_metadata(metadata)

    def set_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        info = metadata.get(0)
        if isinstance(info, PDHandshakeMetadata):
            self.address = (info.host, info.port)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, PDWorkerMeta) and 0 in meta.addresses:
            self.address = meta.addresses[0]

    # -- lookups and allocation ------------------------------------------------------------

    def validate_kv_transfer_params(self, params: dict[str, Any]) -> None:
        self.validate(params)

    def validate(self, params: dict[str, Any]) -> None:
        """Intake check: a decode request's params must be well formed (and signed)."""
        if request_side(params) is Side.DECODE:
            self.checked(params)

    def checked(self, params: dict[str, Any]) -> RemoteParams:
        """A decode request's params, type-, range- and (with a secret) signature-checked."""
        remote = parse_remote(params, self.block_size, self.tp_size, self.windows)
        check_signature(remote, self.signer)
        return remote

    def _side(self, request: Request) -> Side | ParamsError | None:
        try:
            return request_side(request.kv_transfer_params)
        except ParamsError as e:
            return e

    def _parse(self, request: Request, side: Side | ParamsError) -> RemoteParams | ParamsError:
        """The decode request's checked params (cached; logged once when invalid)."""
        rid = request.request_id
        if rid not in self._remote:
            parsed: RemoteParams | ParamsError
            if isinstance(side, ParamsError):
                parsed = side
            else:
                try:
                    parsed = self.checked(request.kv_transfer_params or {})
                    check_prompt(parsed, request.num_prompt_tokens)
                except ParamsError as e:
                    parsed = e
            if isinstance(parsed, ParamsError):
                logger.warning(
                    "%s: request %s has unusable kv_transfer_params: %s", self.label, rid, parsed
                )
            self._remote[rid] = parsed
        return self._remote[rid]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self._side(request)
        if side is None or request.request_id in self._consumed:
            return 0, False
        if side is Side.PREFILL:
            # Prefill only once the workers told us the side-channel address we advertise.
            return (None, False) if self.address is None else (0, False)
        # Decode side, or params too broken to tell: either way an asynchronous "load" that
        # reads the prompt or fails with the reason (kv_load_failure_policy decides then).
        remote = self._parse(request, side)
        if isinstance(remote, RemoteParams):
            self._waiting[request.request_id] = _ref(remote)
        count = request.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        side = self._side(request)
        if side is Side.PREFILL:
            self._expected.append(rid)
            return
        if side is None or num_external_tokens == 0 or rid in self._consumed:
            return
        self._consumed.add(rid)
        self._waiting.pop(rid, None)
        params = request.kv_transfer_params
        if isinstance(params, dict):
            # One transfer per request: a re-admission (preemption) computes locally.
            request.kv_transfer_params = {**params, "do_remote_prefill": False}
        remote = self._parse(request, side)
        if isinstance(remote, ParamsError):
            self._recv.append(RecvSpec(rid, None, [], [], 0, "", error=str(remote)))
            return
        first = (request.num_tokens - num_external_tokens) // self.block_size
        n = remote.remote_num_tokens
        mapped = self._map_blocks(blocks.get_block_ids(), remote, first)
        if isinstance(mapped, str):
            self._recv.append(RecvSpec(rid, None, [], [], 0, "", error=mapped))
            return
        local, read = mapped
        self._recv.append(
            RecvSpec(
                req_id=rid,
                remote=_ref(remote),
                remote_block_ids=remote.flat_block_ids(),
                local_block_ids=local,
                num_tokens=n,
                token_digest=token_digest(request.prompt_token_ids, n),
                first_block=first,
                read_block_ids=read if len(self.windows) > 1 else None,
            )
        )

    def _map_blocks(
        self, tables: tuple[list[int], ...] | list[list[int]], remote: RemoteParams, first: int
    ) -> tuple[list[int], list[int]] | str:
        """(local blocks, remote blocks) to read, paired, group after group: every block
        from ``first`` (the local prefix hit) to the prompt's end that the local table holds
        (a sliding group's blocks outside the window are null blocks there). A message
        instead when the prefill instance did not send a block the local table needs."""
        n = remote.remote_num_tokens
        num_blocks = -(-n // self.block_size)
        local: list[int] = []
        read: list[int] = []
        for g, (table, window) in enumerate(zip(tables, self.windows, strict=True)):
            sent = remote.remote_block_ids[g]
            start = first_sent_block(n, self.block_size, window)
            for pos in range(first, min(num_blocks, len(table))):
                block = table[pos]
                if block == self.null_block and window is not None:
                    continue
                if pos < start:
                    return (
                        f"kv_transfer_params: the prefill instance sent KV cache group {g} "
                        f"from block {start} on, but this instance needs block {pos}"
                    )
                local.append(block)
                read.append(sent[pos - start])
        return local, read

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput | None = None
    ) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(self._recv, self._send, self._expected, self._releases)
        self._recv, self._send, self._expected, self._releases = [], [], [], []
        now = time.monotonic()
        if self._waiting and now >= self._next_heartbeat:
            self._next_heartbeat = now + self.opts.heartbeat_s
            meta.heartbeats = list(self._waiting.values())
        return meta

    # -- finishing -------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._waiting.pop(rid, None)
        self._remote.pop(rid, None)
        consumed = rid in self._consumed
        self._consumed.discard(rid)
        side = self._side(request)
        # A decode request holding no blocks (the server's release path, one never admitted)
        # ends only once the prefill side answered its release: a truthful "released".
        no_blocks = not any(block_ids)
        if side is Side.DECODE and not consumed and self._release_unread(request, no_blocks):
            return True, None
        if side is not Side.PREFILL or request.status not in _HOLD_STATUSES:
            return False, None
        if self.address is None:
            logger.error(
                "%s: %s finished before the side-channel address was known", self.label, rid
            )
            return False, None
        n = request.num_prompt_tokens
        held = self._held_blocks(request, block_ids)
        if held is None:
            return False, None
        flat = [b for group in held for b in group]
        self._send.append(SendSpec(rid, flat, n, token_digest(request.prompt_token_ids, n)))
        stats = request.prefill_stats
        host, port = self.address
        params = decode_params(
            engine_id=self.engine_id,
            request_id=rid,
            host=host,
            port=port,
            block_ids=held if len(held) > 1 else flat,
            num_tokens=n,
            cached_tokens=stats.num_cached_tokens if stats is not None else 0,
            signer=self.signer,
            tp_size=self.tp_size,
        )
        # Family-specific fields beside the signed ones (never read back as trusted).
        return True, {**self.extra_params(request, host, port), **params}

    def _held_blocks(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> list[list[int]] | None:
        """Per group the blocks a decode instance reads (a sliding group: only those in the
        window of the last prompt token), or None (logged) when the request no longer has
        them all."""
        rid, n = request.request_id, request.num_prompt_tokens
        num_blocks = -(-n // self.block_size)
        if len(block_ids) != len(self.windows):
            logger.error(
                "%s: %s finished with %d KV cache groups, expected %d",
                self.label,
                rid,
                len(block_ids),
                len(self.windows),
            )
            return None
        held: list[list[int]] = []
        for table, window in zip(block_ids, self.windows, strict=True):
            group = list(table[first_sent_block(n, self.block_size, window) : num_blocks])
            if len(table) < num_blocks or request.num_computed_tokens < n:
                logger.warning(
                    "%s: %s finished without the KV of its whole prompt", self.label, rid
                )
                return None
            if window is not None and self.null_block in group:
                # Decode steps here moved the window past the prompt's last token.
                logger.warning(
                    "%s: %s finished after its sliding window left the prompt's end; its KV "
                    "is not offered to a decode instance",
                    self.label,
                    rid,
                )
                return None
            held.append(group)
        return held

    def extra_params(self, request: Request, host: str, port: int) -> dict[str, Any]:
        """Fields a family adds to the params it returns (vLLM's names for that connector);
        the signed fields always win over them."""
        return {}

    def _release_unread(self, request: Request, wait: bool = False) -> bool:
        """A decode request that ended before it was admitted (also the server's release
        path): tell the prefill instance it may free the blocks now. Only the params' own
        consistency (and signature) is checked; the prefill side verifies the rest. True
        when the request's own free waits for the answer (``wait``; see ReleaseSpec)."""
        try:
            remote = self.checked(request.kv_transfer_params or {})
        except ParamsError as e:
            logger.warning(
                "%s: cannot release the blocks of %s: %s", self.label, request.request_id, e
            )
            return False
        rid = request.request_id if wait else None
        self._releases.append(ReleaseSpec(_ref(remote), remote.flat_block_ids(), rid))
        return wait

    def has_pending_work(self) -> bool:
        return bool(self._releases)
