"""Typed options of the OffloadingConnector, parsed from ``kv_connector_extra_config``, and
the checks both offload connectors' options share.

Unknown keys and wrong types are rejected by :func:`kvferry.kv_transfer.options.parse_options`
with the list of valid options; the ``validate`` methods check values and combinations.
Sizes are bytes (ints); a count option (``num_cpu_chunks`` ...) overrides the byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import ConfigError
from kvferry.kv_transfer.offload.disk import DEFAULT_READ_TIMEOUT_S
from kvferry.kv_transfer.offload.policies import policy_class

GiB = 1024**3


STORE_MODES = ("auto", "background", "inline")


def check_store_mode(owner: str, value: str) -> None:
    if value not in STORE_MODES:
        raise ConfigError(
            f"{owner}: host_store_mode must be one of {list(STORE_MODES)}, got {value!r}"
        )


def check_positive(owner: str, name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{owner}: {name} must be positive, got {value}")


@dataclass
class OffloadingOptions:
    """Options of the tiered OffloadingConnector.

    Host tier (always on): ``cpu_bytes_to_use`` (required unless ``num_cpu_chunks``), divided
    into chunks of ``blocks_per_chunk`` engine blocks; ``eviction_policy`` "lru" | "arc" | a
    ``module:Class`` path.

    Disk tier (on when ``disk_path`` is set): files under ``disk_path/<fingerprint>/``,
    ``disk_bytes_to_use`` bytes at most (default 10 GiB) or ``num_disk_chunks`` files,
    ``disk_eviction_policy``; ``disk_fsync`` makes each file durable before it is offered
    (slower; a crash can otherwise leave a truncated file, which is detected and ignored).
    Every chunk stored on the host is also written to disk (write-through); a disk-only hit
    is first copied back to the host, checked, then loaded. ``disk_read_timeout_s``: how
    long one file read may take before it is abandoned and the chunk treated as a miss
    (default 5 s). Files are checked with a keyed BLAKE2b when a deployment secret is
    configured (``secret_file``, or ``KVFERRY_KV_SECRET_FILE`` / ``KVFERRY_KV_SECRET``; see
    ``kvferry.kv_transfer.secret``), else with CRC32, which catches accidental corruption
    but not a rewrite by someone who can write to ``disk_path`` (see
    ``kvferry.kv_transfer.offload.disk``).

    ``offload_prompt_only`` (default True, as vLLM): store only chunks inside the prompt.
    ``store_threshold``: store a chunk only once this many requests offered it (1 = always);
    the counter remembers ``max_tracker_size`` keys. ``max_lookup_wait_s``: how long a
    request may wait (seconds) for chunks that are being stored or read back from disk before
    it takes the hit that is ready. A time, not a step count: steps with nothing to compute
    take microseconds, so a count would expire long before a disk read finishes.
    ``host_store_mode`` (both offload connectors): how a CPU engine copies computed blocks
    into host memory. "background": on the copy threads, next to the forward. "inline": in
    the worker right after the forward, by every core at once. "auto" (default): inline when
    torch's threads already take every core the process may use, so that a background copy
    could only take cycles from the forward's OpenMP team (see docs/benchmarks.md);
    background otherwise. CUDA engines always copy on a side stream.
    """

    cpu_bytes_to_use: int | None = None
    num_cpu_chunks: int | None = None
    blocks_per_chunk: int = 1
    eviction_policy: str = "lru"
    disk_path: str | None = None
    disk_bytes_to_use: int = 10 * GiB
    num_disk_chunks: int | None = None
    disk_eviction_policy: str = "lru"
    disk_fsync: bool = False
    disk_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    secret_file: str | None = None
    offload_prompt_only: bool = True
    store_threshold: int = 1
    max_tracker_size: int = 64000
    max_lookup_wait_s: float = 30.0
    host_store_mode: str = "auto"

    def validate(self, owner: str) -> None:
        check_store_mode(owner, self.host_store_mode)
        if self.cpu_bytes_to_use is None and self.num_cpu_chunks is None:
            raise ConfigError(f"{owner}: set cpu_bytes_to_use (or num_cpu_chunks)")
        for name in (
            "cpu_bytes_to_use",
            "num_cpu_chunks",
            "blocks_per_chunk",
            "disk_bytes_to_use",
            "num_disk_chunks",
            "store_threshold",
            "max_tracker_size",
        ):
            check_positive(owner, name, getattr(self, name))
        if self.max_lookup_wait_s < 0:
            raise ConfigError(f"{owner}: max_lookup_wait_s must be >= 0")
        if self.disk_path == "":
            raise ConfigError(f"{owner}: disk_path must not be empty")
        if not self.disk_read_timeout_s > 0:
            raise ConfigError(f"{owner}: disk_read_timeout_s must be positive")
        if self.secret_file == "":
            raise ConfigError(f"{owner}: secret_file must be the path of a file")
        policy_class(self.eviction_policy)
        policy_class(self.disk_eviction_policy)

    def num_host_chunks(self, bytes_per_chunk: int, owner: str) -> int:
        if self.num_cpu_chunks is not None:
            return self.num_cpu_chunks
        assert self.cpu_bytes_to_use is not None
        n = self.cpu_bytes_to_use // bytes_per_chunk
        if n <= 0:
            raise ConfigError(
                f"{owner}: cpu_bytes_to_use={self.cpu_bytes_to_use} holds no chunk "
                f"({bytes_per_chunk} bytes each)"
            )
        return n

    def num_disk_file_chunks(self, bytes_per_file: int, owner: str) -> int:
        if self.num_disk_chunks is not None:
            return self.num_disk_chunks
        n = self.disk_bytes_to_use // bytes_per_file
        if n <= 0:
            raise ConfigError(
                f"{owner}: disk_bytes_to_use={self.disk_bytes_to_use} holds no chunk file "
                f"({bytes_per_file} bytes each)"
            )
        return n
