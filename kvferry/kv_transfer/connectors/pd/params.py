"""The ``kv_transfer_params`` of the P/D connectors (NIXL, Mooncake): which side of a P/D
pair a request is on, and the checked fields a decode instance reads the prefilled KV with.

A request's params are untrusted input (they come from a client or a proxy). Nothing here
trusts a type, a range or a length: :func:`request_side` and :func:`parse_remote` raise
:class:`ParamsError` with one clear sentence instead.

* ``{"do_remote_decode": true}`` on the **prefill** instance: compute the prompt, keep its
  blocks, and return (from ``request_finished``) the params below for the decode instance.
* ``{"do_remote_prefill": true, "remote_engine_id", "remote_request_id", "remote_host",
  "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size", ...}`` on the **decode**
  instance: read those blocks from the prefill instance instead of computing the prompt.
  With a deployment secret they also carry ``kv_signature`` (see :mod:`.auth`), and a decode
  instance reads only with params whose signature verifies.

Hybrid engines (several KV cache groups) send ``remote_block_ids`` as one list per group, as
vLLM does: the full-attention group every block of the prompt, a sliding-window group only
the blocks from the one holding position ``num_tokens - window`` on (the window of the last
prompt token, which the decode instance recomputes; see :func:`first_sent_block`). One group
sends a flat list (a ``[[...]]`` of one group is read the same).
"""

from __future__ import annotations

import hashlib
import struct
from enum import Enum
from typing import Annotated, Any

import msgspec

from kvferry.kv_transfer.connectors.pd.auth import NotAuthenticated, ParamsSigner, SignedFields

# Bounds shared with the side-channel messages (handshake.py).
MAX_ID_LEN = 256
MAX_BLOCKS = 1 << 18
MAX_TOKENS = 1 << 24
MAX_GROUPS = 16
HOST_PATTERN = r"^[A-Za-z0-9.:\[\]_-]+$"

EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=HOST_PATTERN)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
BlockIds = Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS)]
GroupedBlockIds = Annotated[list[BlockIds], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
GroupSizes = Annotated[
    list[Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]], msgspec.Meta(max_length=MAX_GROUPS)
]
NumTokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Signature = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ParamsError(ValueError):
    """Malformed or inconsistent ``kv_transfer_params``; the message is shown as is."""


class Side(Enum):
    PREFILL = "prefill"  # do_remote_decode: this instance prefills, a decode instance reads
    DECODE = "decode"  # do_remote_prefill: this instance reads the prompt's KV, then decodes


class RemoteParams(msgspec.Struct, frozen=True):
    """What a decode request needs to read its prompt's KV from the prefill instance.
    Unknown keys are ignored (proxies add their own), known ones must have the right type."""

    remote_engine_id: EngineId
    remote_request_id: RequestId
    remote_host: Host
    remote_port: Port
    # One list per KV cache group (:func:`parse_remote` accepts a flat list for one group).
    remote_block_ids: GroupedBlockIds
    remote_num_tokens: NumTokens
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    remote_prefill_cached_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] = 0
    kv_signature: Signature | None = None

    def flat_block_ids(self) -> list[int]:
        """Every group's blocks, group after group: what a claim or release names."""
        return [b for group in self.remote_block_ids for b in group]

    def group_sizes(self) -> tuple[int, ...]:
        """Blocks per group for hybrid params; empty for one group (signed as before)."""
        groups = self.remote_block_ids
        return tuple(len(g) for g in groups) if len(groups) > 1 else ()

    def signed_fields(self) -> SignedFields:
        return SignedFields(
            self.remote_engine_id,
            self.remote_request_id,
            self.remote_host,
            self.remote_port,
            self.flat_block_ids(),
            self.remote_num_tokens,
            self.tp_size,
            self.remote_prefill_cached_tokens,
            self.group_sizes(),
        )

    def proof(self) -> ParamsProof | None:
        """What a claim or release carries so the prefill instance can check the signature."""
        if self.kv_signature is None:
            return None
        return ParamsProof(
            self.remote_host,
            self.remote_port,
            self.remote_num_tokens,
            self.remote_prefill_cached_tokens,
            self.kv_signature,
            list(self.group_sizes()),
        )


class ParamsProof(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The signed params' fields a claim or release does not carry itself, and the signature
    (tp_size is the prefill engine's own, which the compatibility hash already pins)."""

    host: Host
    port: Port
    num_tokens: NumTokens
    cached_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
    signature: Signature
    # Hybrid params: blocks per KV cache group of the named (flat) block ids.
    group_sizes: GroupSizes = []

    def fields(
        self, engine_id: str, request_id: str, block_ids: list[int], tp_size: int = 1
    ) -> SignedFields:
        return SignedFields(
            engine_id,
            request_id,
            self.host,
            self.port,
            list(block_ids),
            self.num_tokens,
            tp_size,
            self.cached_tokens,
            tuple(self.group_sizes),
        )


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None or value is False:
        return False
    if value is True:
        return True
    raise ParamsError(f"kv_transfer_params[{key!r}] must be true or false, got {value!r}")


def request_side(params: Any) -> Side | None:
    """The side a request is on by its params (None: no P/D transfer at all).

    Raises ParamsError for params that are not a JSON object, flags that are not booleans,
    and both flags set."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    decode = _flag(params, "do_remote_prefill")
    prefill = _flag(params, "do_remote_decode")
    if decode and prefill:
        raise ParamsError(
            "kv_transfer_params sets both do_remote_prefill and do_remote_decode; "
            "a request is either prefilled here or read from a prefill instance"
        )
    if decode:
        return Side.DECODE
    return Side.PREFILL if prefill else None


def first_sent_block(num_tokens: int, block_size: int, window: int | None) -> int:
    """The first block of a prompt of ``num_tokens`` a group's params carry: block 0 for full
    attention; for a sliding window, the block of position ``num_tokens - window`` (the
    earliest the recomputed last prompt token reads)."""
    return 0 if window is None else max(0, num_tokens - window) // block_size


def parse_remote(
    params: dict[str, Any],
    block_size: int,
    tp_size: int = 1,
    windows: tuple[int | None, ...] = (None,),
) -> RemoteParams:
    """Type- and range-check the fields a decode request reads with.

    ``remote_block_ids`` must hold, per KV cache group of this instance (``windows``: each
    group's sliding window, None for full attention), exactly the blocks the prefill instance
    sends for ``remote_num_tokens`` tokens (see :func:`first_sent_block`), no block twice and
    no null block (block 0) of a hybrid pool; the prefill instance's ``tp_size`` and this
    instance's must divide one another (see :mod:`.tp_slices` for who reads which KV heads)."""
    raw = params.get("remote_block_ids")
    flat_form = isinstance(raw, list) and bool(raw) and not any(isinstance(x, list) for x in raw)
    if flat_form:
        params = {**params, "remote_block_ids": [raw]}  # one group, vLLM's flat form
    try:
        remote = msgspec.convert(params, RemoteParams, strict=True)
    except msgspec.ValidationError as e:
        why = str(e)
        if flat_form:  # name the position in the list the peer sent
            why = why.replace("remote_block_ids[0][", "remote_block_ids[")
        raise ParamsError(f"invalid kv_transfer_params: {why}") from None
    groups = remote.remote_block_ids
    if len(groups) != len(windows):
        raise ParamsError(
            f"invalid kv_transfer_params: remote_block_ids has {len(groups)} KV cache groups "
            f"but this instance has {len(windows)}"
        )
    n = remote.remote_num_tokens
    num_blocks = -(-n // block_size)
    for g, (ids, window) in enumerate(zip(groups, windows, strict=True)):
        need = num_blocks - first_sent_block(n, block_size, window)
        if len(ids) != need:
            where = "remote_block_ids" if len(groups) == 1 else f"remote_block_ids[{g}]"
            kind = "" if window is None else f" in a window of {window}"
            raise ParamsError(
                f"invalid kv_transfer_params: {where} has {len(ids)} blocks but "
                f"remote_num_tokens={n} needs {need} blocks of {block_size} tokens{kind}"
            )
    flat = remote.flat_block_ids()
    if len(flat) > MAX_BLOCKS:
        raise ParamsError(f"invalid kv_transfer_params: more than {MAX_BLOCKS} remote blocks")
    if len(set(flat)) != len(flat):
        raise ParamsError("invalid kv_transfer_params: remote_block_ids has duplicates")
    if len(groups) > 1 and 0 in flat:
        raise ParamsError(
            "invalid kv_transfer_params: remote_block_ids names block 0, the null block of a "
            "hybrid pool"
        )
    if len(groups) > 1 and remote.tp_size != tp_size:
        # Untested across TP sizes with several groups: refused rather than trusted.
        raise ParamsError(
            f"kv_transfer_params has tp_size={remote.tp_size}, but this instance runs "
            f"tensor_parallel_size={tp_size}; P/D of a hybrid model (several KV cache groups) "
            f"needs equal tensor-parallel sizes"
        )
    if remote.tp_size % tp_size and tp_size % remote.tp_size:
        raise ParamsError(
            f"kv_transfer_params has tp_size={remote.tp_size}, but this instance runs "
            f"tensor_parallel_size={tp_size}; kvferry reads from a prefill instance only when "
            f"one of the two tensor-parallel sizes divides the other"
        )
    return remote


def check_signature(remote: RemoteParams, signer: ParamsSigner | None) -> None:
    """With a deployment secret, the params must carry a valid signature of every field read."""
    if signer is not None:
        try:
            signer.verify(remote.signed_fields(), remote.kv_signature)
        except NotAuthenticated as e:
            raise ParamsError(str(e)) from None


def check_prompt(remote: RemoteParams, num_prompt_tokens: int) -> None:
    """The decode request's prompt must be the one the prefill instance computed."""
    if remote.remote_num_tokens != num_prompt_tokens:
        raise ParamsError(
            f"kv_transfer_params names a prefill of {remote.remote_num_tokens} tokens but this "
            f"request's prompt has {num_prompt_tokens}"
        )


def token_digest(token_ids: list[int], num_tokens: int) -> str:
    """A digest of the first ``num_tokens`` token ids, identical on every machine: the
    prefill instance only hands its blocks to a reader whose prompt has the same digest."""
    h = hashlib.sha256()
    chunk = 4096
    for start in range(0, num_tokens, chunk):
        ids = token_ids[start : min(num_tokens, start + chunk)]
        h.update(struct.pack(f"<{len(ids)}q", *ids))
    return h.hexdigest()[:32]


def decode_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: list[int] | list[list[int]],
    num_tokens: int,
    cached_tokens: int,
    signer: ParamsSigner | None = None,
    tp_size: int = 1,
) -> dict[str, Any]:
    """The params a prefill instance returns for the decode instance (vLLM's field names),
    signed when ``signer`` is given. ``block_ids``: a flat list (one KV cache group) or one
    list per group (hybrid)."""
    grouped = [list(g) for g in block_ids if isinstance(g, list)]
    flat = (
        [b for g in grouped for b in g] if grouped else [b for b in block_ids if isinstance(b, int)]
    )
    sizes = tuple(len(g) for g in grouped) if len(grouped) > 1 else ()
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": grouped if len(grouped) > 1 else flat,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "remote_prefill_cached_tokens": cached_tokens,
    }
    if signer is not None:
        fields = SignedFields(
            engine_id, request_id, host, port, flat, num_tokens, tp_size, cached_tokens, sizes
        )
        params["kv_signature"] = signer.sign(fields)
    return params
