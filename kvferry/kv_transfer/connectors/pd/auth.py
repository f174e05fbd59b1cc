"""Who may talk to a P/D connector (NIXL or Mooncake): the deployment secret applied to its
peer traffic.

With a deployment secret (:mod:`kvferry.kv_transfer.secret`) configured:

* **Side channel** (:class:`EnvelopeAuth`): every frame, both directions, carries an
  HMAC-SHA256 over the whole envelope (compatibility hash and description, body, timestamp,
  nonce, and for a reply the nonce of the request it answers). A receiver checks the MAC
  before anything else. Replays: a request is accepted only if its timestamp is within
  ``window`` seconds of the receiver's clock and its nonce is not among those accepted in the
  last ``2 * window`` seconds; a reply only if it names the nonce of the request it answers,
  so a recorded reply cannot answer a later request. Only authenticated requests enter the
  nonce memory, so an outsider cannot fill it. The READ-completion notification a reader
  attaches to its transfer carries a MAC too (it ends a hold; request ids are used once,
  so a replayed one matches no hold).
* **kv_transfer_params** (:class:`ParamsSigner`): the params a prefill instance returns carry
  ``kv_signature``, an HMAC over a canonical encoding of every field a decode instance reads
  (engine and request id, host, port, block ids, token counts, tp size) and an expiry. A
  decode instance refuses unsigned, altered or expired params at intake; a prefill instance
  refuses claims and releases that do not name params it signed.

The two uses take different keys derived from the secret. Without a secret nothing is
signed; the connector then refuses to expose its side channel beyond loopback unless
``allow_unauthenticated`` is set.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvferry.config import ConfigError
from kvferry.kv_transfer.secret import DeploymentSecret, load_deployment_secret

if TYPE_CHECKING:
    from kvferry.kv_transfer.connectors.pd.options import PDOptions

MAC_BYTES = 32
NONCE_BYTES = 16
ENVELOPE_DOMAIN = b"kvferry/nixl-envelope/2\0"
NOTIF_DOMAIN = b"kvferry/nixl-read-done/2\0"
_PARAMS_VERSION = "1"
_MAX_NONCES = 1 << 20


class NotAuthenticated(ValueError):
    """A message or params without valid proof that a holder of the secret issued them."""


class EnvelopeAuth:
    """MACs side-channel envelopes and remembers the nonces of accepted requests."""

    def __init__(self, key: bytes, window_s: float, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self.window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> forget after
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock()

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def mac(self, parts: Sequence[bytes], domain: bytes = ENVELOPE_DOMAIN) -> bytes:
        """HMAC-SHA256 over ``domain``, the parts' lengths and the parts (one encoding,
        whatever the wire)."""
        lengths = struct.pack(f"<{len(parts)}Q", *map(len, parts))
        return hmac.digest(self._key, b"".join((domain, lengths, *parts)), "sha256")

    def verify(self, parts: Sequence[bytes], mac: bytes, domain: bytes = ENVELOPE_DOMAIN) -> None:
        if len(mac) != MAC_BYTES or not hmac.compare_digest(self.mac(parts, domain), mac):
            raise NotAuthenticated("the message's MAC does not verify")

    def admit(self, sent_at: float, nonce: bytes) -> None:
        """Accept an authenticated request once: fresh timestamp, unseen nonce."""
        now = self._clock()
        if not abs(now - sent_at) <= self.window_s:
            raise NotAuthenticated(
                f"the message is {now - sent_at:+.1f}s old, outside the {self.window_s}s window "
                f"(replayed, or the clocks differ)"
            )
        if len(nonce) != NONCE_BYTES:
            raise NotAuthenticated("the message has no valid nonce")
        with self._lock:
            seen = self._seen
            while seen and next(iter(seen.values())) < now:
                seen.popitem(last=False)
            if nonce in seen:
                raise NotAuthenticated("the message was already received (a replay)")
            if len(seen) >= _MAX_NONCES:
                raise NotAuthenticated("too many messages in the replay window")
            # Later insertions never expire earlier (max), so expiry order is insertion order.
            last = next(reversed(seen.values())) if seen else now
            seen[nonce] = max(last, now + 2 * self.window_s)


@dataclass(frozen=True)
class SignedFields:
    """What a decode instance reads KV with, as a prefill instance issued it."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int
    tp_size: int
    cached_tokens: int
    # Hybrid engines: how many of ``block_ids`` each KV cache group has (empty: one group).
    group_sizes: tuple[int, ...] = ()


class ParamsSigner:
    """Signs and verifies ``kv_signature``: ``"1.<expiry, unix seconds>.<hex HMAC>"``."""

    def __init__(
        self, key: bytes, lifetime_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self._key = key
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._enc = msgspec.msgpack.Encoder()

    def _mac(self, f: SignedFields, expires: int) -> str:
        data = self._enc.encode(
            [
                "kvferry/kv-params",
                _PARAMS_VERSION,
                expires,
                f.engine_id,
                f.request_id,
                f.host,
                f.port,
                f.block_ids,
                f.num_tokens,
                f.tp_size,
                f.cached_tokens,
                # Only hybrid params carry the group structure (one group signs as before).
                *([list(f.group_sizes)] if f.group_sizes else []),
            ]
        )
        return hmac.digest(self._key, data, "sha256").hex()

    def sign(self, fields: SignedFields) -> str:
        expires = int(self._clock() + self.lifetime_s) + 1
        return f"{_PARAMS_VERSION}.{expires}.{self._mac(fields, expires)}"

    def verify(self, fields: SignedFields, signature: object) -> None:
        """Raise NotAuthenticated unless ``signature`` is ours for exactly these fields and
        has not expired."""
        if signature is None:
            raise NotAuthenticated(
                "kv_transfer_params are not signed (no kv_signature); this instance reads KV "
                "only with params a prefill instance of its deployment issued"
            )
        ok = isinstance(signature, str) and signature.isascii() and len(signature) <= 128
        parts = signature.split(".") if isinstance(signature, str) and ok else []
        if len(parts) != 3 or parts[0] != _PARAMS_VERSION or not parts[1].isdigit():
            raise NotAuthenticated("kv_transfer_params have a malformed kv_signature")
        expires = int(parts[1])
        if not hmac.compare_digest(self._mac(fields, expires), parts[2]):
            raise NotAuthenticated(
                "the kv_signature of kv_transfer_params does not verify (the params were "
                "altered, or issued by an instance without this deployment's secret)"
            )
        if self._clock() > expires:
            raise NotAuthenticated("kv_transfer_params have expired")


@dataclass(frozen=True)
class PeerAuth:
    """Both uses of the secret, as the connector configures them."""

    envelope: EnvelopeAuth
    params: ParamsSigner
    source: str


def load_peer_auth(opts: PDOptions) -> PeerAuth | None:
    """The connector's authentication, or None when no deployment secret is configured."""
    secret: DeploymentSecret | None = load_deployment_secret(
        {"secret_file": opts.secret_file} if opts.secret_file is not None else None
    )
    if secret is None:
        return None
    return PeerAuth(
        EnvelopeAuth(secret.key_for("nixl-side-channel"), opts.auth_window),
        ParamsSigner(secret.key_for("nixl-kv-params"), opts.params_lifetime_s),
        secret.source,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or "*") may resolve to, or listen on, anything


def check_exposure(
    host: str, auth: PeerAuth | None, allow_unauthenticated: bool, owner: str
) -> None:
    """Refuse to listen beyond loopback without a secret unless explicitly allowed."""
    if auth is None and not allow_unauthenticated and not is_loopback(host):
        raise ConfigError(
            f"{owner}: the P/D side channel would listen on {host}, beyond loopback, without "
            f"authentication; configure a deployment secret (KVFERRY_KV_SECRET_FILE or the "
            f"secret_file option, see docs/security.md), bind it to 127.0.0.1, or set "
            f"allow_unauthenticated: true"
        )
