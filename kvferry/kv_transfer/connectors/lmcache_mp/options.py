"""Typed options of the LMCacheMPConnector, parsed from ``kv_connector_extra_config``.

The keys are LMCache's own ``lmcache.mp.*`` keys, with the meaning and defaults they have
for vLLM's LMCacheMPConnector, so a vLLM deployment's config works unchanged:

- ``lmcache.mp.server_urls``: the server's URL (a list or comma-separated string; kvferry
  runs one worker per engine, so exactly one URL). Without it, ``lmcache.mp.host``
  (default ``tcp://localhost``) and ``lmcache.mp.port`` (default 5555) name the server; a
  URL without a scheme gets ``tcp://``.
- ``lmcache.mp.mq_timeout`` (300 s): how long a blocking request to the server may take
  (chunk size query, KV cache registration, an unanswered lookup).
- ``lmcache.mp.heartbeat_interval`` (10 s): seconds between health pings; a failed ping puts
  the adapters in degraded mode (lookups miss, stores are dropped) until the server answers
  again (then the worker registers its KV caches again).
- ``lmcache.mp.nonblocking_lookup_status`` (True), ``lmcache.mp.mp_transfer_mode`` ("auto":
  engine-driven copies on CPU), ``lmcache.mp.isolated_ipc`` (False), ``lmcache.mp.use_vmm_api``
  (False), ``lmcache.mp.hash_algorithm`` ("blake3"): handed to LMCache's adapters as is.
- ``lmcache.mp.eager_prefetch`` (False): start the lookup when a request arrives instead of
  when it is first scheduled.
- ``lmcache.mp.save_decode_cache`` (False): only False is supported (prompt chunks stored).

Values may be typed (JSON) or strings (a CLI passthrough), as LMCache accepts them.
LMCache keys that kvferry does not implement (``lazy_offload``, ``autostart*``,
``transfer_intermediate_tensors``) and any other key are refused with the list of valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvferry.config import ConfigError

PREFIX = "lmcache.mp."

TRANSFER_MODES = ("auto", "lmcache_driven", "engine_driven")
HASH_ALGORITHMS = ("builtin", "sha256_cbor", "blake3")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# LMCache keys with a meaning kvferry does not (yet) provide, and why.
UNSUPPORTED = {
    "lazy_offload": "kvferry stores each prompt chunk right after the step that computed it",
    "autostart": "start the LMCache server yourself (or with kvferry's server launcher)",
    "autostart.server_args": "start the LMCache server yourself",
    "autostart.wait_timeout": "start the LMCache server yourself",
    "transfer_intermediate_tensors": "kvferry has no pipeline parallelism",
}


@dataclass(frozen=True)
class LMCacheMPOptions:
    """The connector's resolved options (field names are the keys without ``lmcache.mp.``)."""

    server_urls: tuple[str, ...] = ()
    host: str = "tcp://localhost"
    port: int = 5555
    mq_timeout: float = 300.0
    heartbeat_interval: float = 10.0
    nonblocking_lookup_status: bool = True
    mp_transfer_mode: str = "auto"
    isolated_ipc: bool = False
    use_vmm_api: bool = False
    hash_algorithm: str = "blake3"
    eager_prefetch: bool = False
    save_decode_cache: bool = False

    @property
    def server_url(self) -> str:
        url = self.server_urls[0] if self.server_urls else f"{self.host}:{self.port}"
        return url if "://" in url else f"tcp://{url}"

    def adapter_config(self) -> dict[str, Any]:
        """The ``lmcache.mp.*`` dict LMCache's adapters read (validated values only)."""
        keys = (
            "mq_timeout",
            "heartbeat_interval",
            "nonblocking_lookup_status",
            "isolated_ipc",
            "use_vmm_api",
            "hash_algorithm",
        )
        out: dict[str, Any] = {PREFIX + k: getattr(self, k) for k in keys}
        if self.mp_transfer_mode != "auto":
            # The worker adapter treats the key's presence as an override of
            # LMCACHE_MP_TRANSFER_MODE, so pass it only when set.
            out[PREFIX + "mp_transfer_mode"] = self.mp_transfer_mode
        return out


def _as_bool(owner: str, key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{owner}: {PREFIX}{key} must be a boolean, got {raw!r}")


def _as_number(owner: str, key: str, raw: Any, kind: type) -> Any:
    if isinstance(raw, bool):
        raise ConfigError(f"{owner}: {PREFIX}{key} must be a number, got {raw!r}")
    try:
        value = kind(raw)
        if kind is int and isinstance(raw, float) and raw != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"{owner}: {PREFIX}{key} must be {'an integer' if kind is int else 'a number'}, "
            f"got {raw!r}"
        ) from None
    return value


def _as_urls(owner: str, raw: Any) -> tuple[str, ...]:
    if isinstance(raw, str):
        urls = [u.strip() for u in raw.split(",") if u.strip()]
    elif isinstance(raw, (list, tuple)) and all(isinstance(u, str) for u in raw):
        urls = [u.strip() for u in raw if u.strip()]
    else:
        raise ConfigError(
            f"{owner}: {PREFIX}server_urls must be a list of URLs or a comma-separated string, "
            f"got {raw!r}"
        )
    if len(urls) != 1:
        raise ConfigError(
            f"{owner}: {PREFIX}server_urls must name exactly one server (kvferry runs one "
            f"worker per engine, and LMCache assigns servers to workers), got {urls}"
        )
    return tuple(urls)


def parse_lmcache_options(extra: dict[str, Any], owner: str) -> LMCacheMPOptions:
    """Build and check the options from ``kv_connector_extra_config``."""
    names = [f.name for f in fields(LMCacheMPOptions)]
    valid = sorted(PREFIX + n for n in names)
    values: dict[str, Any] = {}
    unknown = []
    for key, raw in extra.items():
        short = key[len(PREFIX) :] if key.startswith(PREFIX) else None
        if short in UNSUPPORTED:
            raise ConfigError(
                f"{owner}: {key} is not supported by kvferry's LMCacheMPConnector "
                f"({UNSUPPORTED[short]})"
            )
        if short is None or short not in names:
            unknown.append(key)
            continue
        values[short] = raw
    if unknown:
        raise ConfigError(
            f"{owner}: unknown kv_connector_extra_config option(s) {sorted(unknown)}; "
            f"valid options are {valid}"
        )
    typed: dict[str, Any] = {}
    for key, raw in values.items():
        if key == "server_urls":
            typed[key] = _as_urls(owner, raw)
        elif key in ("host", "mp_transfer_mode", "hash_algorithm"):
            if not isinstance(raw, str) or not raw.strip():
                raise ConfigError(f"{owner}: {PREFIX}{key} must be a non-empty string")
            typed[key] = raw.strip()
        elif key == "port":
            typed[key] = _as_number(owner, key, raw, int)
        elif key in ("mq_timeout", "heartbeat_interval"):
            typed[key] = _as_number(owner, key, raw, float)
        else:
            typed[key] = _as_bool(owner, key, raw)
    opts = LMCacheMPOptions(**typed)
    _validate(opts, owner)
    return opts


def _validate(opts: LMCacheMPOptions, owner: str) -> None:
    if not 0 < opts.port < 65536:
        raise ConfigError(f"{owner}: {PREFIX}port must be in 1..65535, got {opts.port}")
    for key in ("mq_timeout", "heartbeat_interval"):
        value = getattr(opts, key)
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{owner}: {PREFIX}{key} must be a positive number of seconds")
    if opts.mp_transfer_mode not in TRANSFER_MODES:
        raise ConfigError(
            f"{owner}: {PREFIX}mp_transfer_mode must be one of {list(TRANSFER_MODES)}, "
            f"got {opts.mp_transfer_mode!r}"
        )
    if opts.hash_algorithm not in HASH_ALGORITHMS:
        raise ConfigError(
            f"{owner}: {PREFIX}hash_algorithm must be one of {list(HASH_ALGORITHMS)}, "
            f"got {opts.hash_algorithm!r}"
        )
    if opts.save_decode_cache:
        raise ConfigError(
            f"{owner}: {PREFIX}save_decode_cache=True is not supported by kvferry's "
            "LMCacheMPConnector (it stores the prompt's complete chunks)"
        )
