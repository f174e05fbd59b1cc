"""An outsider on the NIXL side channel: knows the model, the protocol and the prefill's address
(from params it was issued as an ordinary client), but not the deployment secret.

It builds the instance's compatibility description itself (same model folder and engine
settings), so its envelopes are well formed and name the right compatibility hash; what it
lacks is only the MAC. Replies are decoded without the typed decoder, so whatever the
instance answers (agent metadata, a grant, a refusal) is seen as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvferry.kv_transfer.connectors.pd import handshake


def compat_of(model: Path, num_blocks: int = 128) -> handshake.Compat:
    """The compatibility description a ``serve`` of ``model`` with the suite's engine flags
    computes (the number of blocks is not part of it)."""
    import torch

    from kvferry.engine.arg_utils import EngineArgs
    from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec

    config = EngineArgs(
        model=str(model), dtype="float32", max_model_len=512, max_num_batched_tokens=512
    ).create_engine_config()
    arch = config.model_config.arch
    group = KVCacheGroupSpec(
        layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(arch.num_hidden_layers)),
        block_size=config.cache_config.block_size,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        dtype=torch.float32,
    )
    return handshake.Compat.of(config, KVCacheConfig(num_blocks=num_blocks, groups=(group,)))


class Outsider:
    """Sends side-channel requests as a peer without the secret would."""

    def __init__(self, compat: handshake.Compat) -> None:
        self.ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
        self.compat = compat
        self.unsigned = handshake.Codec(compat)
        self.wrong_key = _wrong_key_codec(compat)
        self._enc = msgspec.msgpack.Encoder()

    def frames(self, msg: msgspec.Struct) -> dict[str, bytes]:
        """The same request as: unsigned with the right compatibility hash, signed with a
        key that is not the deployment's (when this kvferry signs at all), and with a
        garbage compatibility hash."""
        out = {"unsigned": self.unsigned.encode(msg)}
        if self.wrong_key is not None:
            out["wrong key"] = self.wrong_key.encode(msg)
        body = self._enc.encode(msg)
        out["bad compat hash"] = self._enc.encode(handshake.Envelope("0" * 32, "x", body))
        return out

    def ask(self, host: str, port: int, frame: bytes, timeout_s: float = 5.0) -> dict[str, Any]:
        """One request; the reply's body as a plain dict (``{"type": "refused", ...}``), or
        ``{"type": "no answer"}``."""
        sock = self.ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(frame)
            if not sock.poll(int(timeout_s * 1000)):
                return {"type": "no answer"}
            raw = sock.recv()
        finally:
            sock.close()
        env = msgspec.msgpack.decode(raw)
        body = msgspec.msgpack.decode(env[2]) if isinstance(env, list) and len(env) > 2 else env
        return body if isinstance(body, dict) else {"type": "unreadable", "raw": repr(body)[:200]}

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _wrong_key_codec(compat: handshake.Compat) -> handshake.Codec | None:
    try:
        from kvferry.kv_transfer.connectors.pd.auth import EnvelopeAuth, ParamsSigner, PeerAuth
    except ImportError:
        return None
    key = os.urandom(32)
    try:
        auth = PeerAuth(EnvelopeAuth(key, 30.0), ParamsSigner(key, 60.0), "outsider")
        return handshake.Codec(compat, auth)  # type: ignore[call-arg]
    except TypeError:
        return None


# Text only the full compatibility description has: a refusal naming it tells an outsider
# how to build an accepted handshake.
DESC_MARKERS = ("layout=", "weights=", "dtype=", "protocol=")


def leaks_compat(reply: dict[str, Any]) -> bool:
    reason = str(reply.get("reason", ""))
    return any(m in reason for m in DESC_MARKERS)
