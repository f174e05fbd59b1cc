"""A thin typed wrapper over ``mooncake.store.MooncakeDistributedStore``.

Every call returns a typed result and never raises: Mooncake returns negative codes for
errors (``-704`` object not found, ``-900`` master unreachable, ...) and may raise from its
bindings; both become ``None``/negative entries here, so a store that misbehaves never fails
an engine step. Calls can block for seconds while the master is unreachable (Mooncake retries
its RPC), so callers run them off the engine thread.

Mooncake's client reconnects to a master that comes back on the same address by itself (it
re-registers and remounts its segment); :meth:`MooncakeStoreClient.probe` tells whether the
master answers now.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.kv_transfer.stores.mooncake_config import MooncakeStoreConfig
from kvferry.logger import init_logger

logger = init_logger(__name__)

OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
CALL_RAISED = -1
NOT_CONNECTED = -2
_PROBE_KEY = "kvferry/probe"


def mooncake_available() -> str | None:
    """None when Mooncake's store client can be imported, else why not."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return (
            f"the Mooncake store client is not installed ({e}); install it with "
            "`pip install kvferry[mooncake]` (mooncake-transfer-engine-non-cuda, which needs "
            "the system's libibverbs1)"
        )
    return None


@dataclass(frozen=True)
class ReplicateOptions:
    """Mooncake's ``ReplicateConfig`` for puts: replicas, hard pin, soft-pin TTL and the
    preferred segment (None: Mooncake's defaults)."""

    replica_num: int = 1
    with_hard_pin: bool = False
    soft_pin_ttl_ms: int | None = None
    preferred_segment: str | None = None

    def build(self) -> Any:
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = self.replica_num
        rc.with_hard_pin = self.with_hard_pin
        if self.soft_pin_ttl_ms is not None:
            rc.soft_pin_ttl_ms = self.soft_pin_ttl_ms
        if self.preferred_segment is not None:
            rc.preferred_segment = self.preferred_segment
        return rc


class MooncakeStoreClient:
    """One Mooncake Store client (its own transfer engine and, when ``global_segment_size``
    is positive, a segment of this process's memory lent to the store)."""

    def __init__(self, config: MooncakeStoreConfig, replicate: ReplicateOptions | None = None):
        self.config = config
        self.replicate = replicate or ReplicateOptions()
        self._store: Any = None
        self._rc: Any = None
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()  # setup / close against each other

    @property
    def connected(self) -> bool:
        return self._store is not None

    def setup(self) -> str | None:
        """Connect; None on success, else the reason."""
        with self._lock:
            if self._store is not None:
                return None
            why = mooncake_available()
            if why is not None:
                return why
            from mooncake.store import MooncakeDistributedStore

            c = self.config
            try:
                store = MooncakeDistributedStore()
                rc = store.setup(
                    c.local_hostname,
                    c.metadata_server,
                    c.global_segment_size,
                    c.local_buffer_size,
                    c.protocol,
                    c.device_name,
                    c.master_server_address,
                )
            except Exception as e:  # the bindings raise on bad arguments
                return f"setup raised {type(e).__name__}: {e}"
            if rc != 0:
                return f"setup returned {rc} (is the master at {c.master_server_address} up?)"
            try:
                self._rc = self.replicate.build()
            except Exception as e:
                store.close()
                return f"bad replication options: {e}"
            for ptr, size in self._registered:
                if store.register_buffer(ptr, size) != 0:
                    store.close()
                    return f"register_buffer({size} bytes) failed"
            self._store = store
            return None

    def register_buffer(self, ptr: int, size: int) -> bool:
        """Register host memory for zero-copy puts and gets (kept across reconnects)."""
        self._registered.append((ptr, size))
        store = self._store
        if store is None:
            return True  # registered at setup
        try:
            return bool(store.register_buffer(ptr, size) == 0)
        except Exception:
            return False

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each key is stored; None when the store could not answer."""
        store = self._store
        if store is None or not keys:
            return None if store is None else []
        try:
            codes = store.batch_is_exist(list(keys))
        except Exception:
            return None
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            return None
        return [c == 1 for c in codes]

    def put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Store each ``(key, registered ptr, size)``; per key 0 or a negative error code."""
        store = self._store
        if store is None:
            return [NOT_CONNECTED] * len(keys)
        try:
            codes = store.batch_put_from(list(keys), list(ptrs), list(sizes), self._rc)
        except Exception:
            return [CALL_RAISED] * len(keys)
        return _fit(codes, len(keys))

    def get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read each key into its registered buffer; per key the bytes read or a negative
        error code (:data:`OBJECT_NOT_FOUND`, a buffer too small, ...)."""
        store = self._store
        if store is None:
            return [NOT_CONNECTED] * len(keys)
        try:
            codes = store.batch_get_into(list(keys), list(ptrs), list(sizes))
        except Exception:
            return [CALL_RAISED] * len(keys)
        return _fit(codes, len(keys))

    def remove(self, keys: Sequence[str]) -> list[int]:
        store = self._store
        if store is None:
            return [NOT_CONNECTED] * len(keys)
        try:
            return _fit(store.batch_remove(list(keys), True), len(keys))
        except Exception:
            return [CALL_RAISED] * len(keys)

    def probe(self) -> bool:
        """True when the master answers now (a cheap existence query)."""
        return self.exists([_PROBE_KEY]) is not None

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            for ptr, _ in self._registered:
                with contextlib.suppress(Exception):
                    store.unregister_buffer(ptr)
            try:
                store.close()
            except Exception as e:
                logger.warning("mooncake store close failed: %s", e)


def _fit(codes: Sequence[int], n: int) -> list[int]:
    out = [int(c) for c in codes]
    return out if len(out) == n else [CALL_RAISED] * n
