"""The engine's own settings (cache, scheduler, parallel, device), EngineConfig that ties them
to the model and KV transfer configs, and the scheduler's check against the allocated pool."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from kvferry.config.errors import ConfigError
from kvferry.config.kv_events import KVEventsConfig
from kvferry.config.kv_transfer import KVTransferConfig
from kvferry.config.model import ModelConfig

# kvferry's own block hash first, then vLLM's names (vllm.config.cache.PrefixCachingHashAlgo).
PREFIX_CACHING_HASH_ALGOS = ("kvferry", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_HASH_ALGO_PACKAGES = {"sha256_cbor": "cbor2", "xxhash": "xxhash", "xxhash_cbor": "xxhash"}


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    # "kvferry" (canonical SHA-256, see core.block_hash) or one of vLLM's algorithms.
    prefix_caching_hash_algo: str = "kvferry"
    # A CPU pool's pages taken at start-up (True, the default, as vLLM zero-fills its pool) or
    # on each block's first use (False). KVFERRY_KV_POOL_PREFAULT=1/0, when set, decides.
    kv_pool_prefault: bool = True

    def __post_init__(self) -> None:
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ConfigError(
                f"prefix_caching_hash_algo {self.prefix_caching_hash_algo!r} is not one of "
                f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}"
            )
        # Checked here, before the model loads, rather than when the first request is hashed.
        package = _HASH_ALGO_PACKAGES.get(self.prefix_caching_hash_algo)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"prefix_caching_hash_algo {self.prefix_caching_hash_algo!r} needs the "
                f"{package} package: pip install {package}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {n!r}")


@dataclass
class DeviceConfig:
    device: str = "auto"
    torch_device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA device is available")
        if not (name == "cpu" or name.startswith("cuda")):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        self.torch_device = torch.device(name)


@dataclass
class EngineConfig:
    """Everything an engine instance needs; built from EngineArgs and cross-checked here."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    log_stats: bool = False

    def __post_init__(self) -> None:
        sc, mc = self.scheduler_config, self.model_config
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < mc.max_len:
            raise ConfigError(
                f"with chunked prefill off, max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) must be >= max_model_len ({mc.max_len})"
            )
        check_tensor_parallel(self)
        kvt = self.kv_transfer_config
        if kvt is not None and kvt.kv_connector is None:
            self.kv_transfer_config = None
        if self.cache_config.num_kv_blocks is not None:
            need = -(-mc.max_len // self.cache_config.block_size)
            if self.cache_config.num_kv_blocks < need:
                raise ConfigError(
                    f"num_kv_blocks={self.cache_config.num_kv_blocks} cannot hold one request "
                    f"of max_model_len={mc.max_len} ({need} blocks of {self.cache_config.block_size} "
                    f"tokens needed); raise it or lower max_model_len"
                )


def check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a tensor-parallel size the model's shapes or the devices cannot be split over."""
    n = config.parallel_config.tensor_parallel_size
    if n == 1:
        return
    arch = config.model_config.arch
    for what, value in (
        ("attention heads (num_attention_heads)", arch.num_attention_heads),
        ("KV heads (num_key_value_heads)", arch.num_key_value_heads),
        ("MLP width (intermediate_size)", arch.intermediate_size),
    ):
        if value % n:
            raise ConfigError(
                f"tensor_parallel_size={n} does not divide the model's {value} {what}; "
                f"choose a tensor_parallel_size that divides it"
            )
    device = config.device_config.torch_device
    if device.type == "cuda":
        if device.index is not None:
            raise ConfigError(
                f"with tensor_parallel_size={n} use device 'cuda' (rank r runs on cuda:r), "
                f"not {str(device)!r}"
            )
        if torch.cuda.device_count() < n:
            raise ConfigError(
                f"tensor_parallel_size={n} needs {n} CUDA devices, found "
                f"{torch.cuda.device_count()}"
            )


def check_scheduler_limits(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    kv_block_size: int,
    max_model_len: int,
) -> None:
    """Raise ConfigError for settings the scheduler cannot work with; ``kv_block_size`` is the
    block size of the KV pool the workers allocated."""
    if cache_config.block_size != kv_block_size:
        raise ConfigError(
            f"cache block_size {cache_config.block_size} != KV cache config block_size "
            f"{kv_block_size}"
        )
    if (
        not scheduler_config.enable_chunked_prefill
        and scheduler_config.max_num_batched_tokens < max_model_len
    ):
        raise ConfigError(
            f"with chunked prefill off, max_num_batched_tokens "
            f"({scheduler_config.max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}), or long prompts could never be scheduled"
        )
