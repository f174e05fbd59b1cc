"""``VllmConfig`` and its parts as vLLM names them: views over kvferry's ``EngineConfig``.

Each view reads kvferry's config objects on every access (nothing is copied), adds vLLM's
names and methods where kvferry's differ (``model_config.dtype`` is the torch dtype, as in
vLLM), and hands any other attribute through to the kvferry object it wraps, so kvferry's own
names keep working on a vLLM-style connector's config too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvferry.config import EngineConfig, KVEventsConfig, KVTransferConfig

if TYPE_CHECKING:
    from kvferry.config import CacheConfig as KvferryCacheConfig
    from kvferry.config import DeviceConfig as KvferryDeviceConfig
    from kvferry.config import ModelConfig as KvferryModelConfig
    from kvferry.config import ParallelConfig as KvferryParallelConfig
    from kvferry.config import SchedulerConfig as KvferrySchedulerConfig
    from kvferry.config.arch import ArchConfig

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "VllmConfig",
]


class _View:
    """Hands unknown attributes to the wrapped kvferry object."""

    _wrapped: Any

    def __getattr__(self, name: str) -> Any:
        if name == "_wrapped":
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"


class ModelConfig(_View):
    def __init__(self, model_config: KvferryModelConfig) -> None:
        self._wrapped = model_config

    @property
    def model(self) -> str:
        return self._wrapped.model

    @property
    def served_model_name(self) -> str:
        return self._wrapped.model

    @property
    def tokenizer(self) -> str | None:
        return self._wrapped.tokenizer

    @property
    def dtype(self) -> torch.dtype:
        return self._wrapped.torch_dtype

    @property
    def max_model_len(self) -> int:
        return self._wrapped.max_len

    @property
    def seed(self) -> int:
        return self._wrapped.seed

    @property
    def hf_config(self) -> ArchConfig:
        """The checkpoint's architecture, with Hugging Face's field names."""
        return self._wrapped.arch

    hf_text_config = hf_config

    @property
    def architecture(self) -> str:
        return self._wrapped.arch.architecture

    @property
    def architectures(self) -> list[str]:
        return [self._wrapped.arch.architecture]

    # kvferry runs dense decoder-only models with full attention.
    use_mla = False
    is_hybrid = False
    is_attention_free = False
    is_multimodal_model = False

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self._wrapped.arch.num_hidden_layers

    def get_total_num_kv_heads(self) -> int:
        return self._wrapped.arch.num_key_value_heads

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        tp = 1 if parallel_config is None else parallel_config.tensor_parallel_size
        return max(1, self._wrapped.arch.num_key_value_heads // tp)

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        tp = 1 if parallel_config is None else parallel_config.tensor_parallel_size
        return self._wrapped.arch.num_attention_heads // tp

    def get_head_size(self) -> int:
        return self._wrapped.arch.head_dim

    def get_hidden_size(self) -> int:
        return self._wrapped.arch.hidden_size

    def get_vocab_size(self) -> int:
        return self._wrapped.arch.vocab_size

    def get_sliding_window(self) -> int | None:
        return None


class CacheConfig(_View):
    def __init__(self, cache_config: KvferryCacheConfig) -> None:
        self._wrapped = cache_config

    @property
    def block_size(self) -> int:
        return self._wrapped.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._wrapped.enable_prefix_caching

    @property
    def num_gpu_blocks(self) -> int | None:
        return self._wrapped.num_kv_blocks

    # The KV pool is stored in the model's dtype ("auto"); kvferry has no quantized KV.
    cache_dtype = "auto"

    @property
    def prefix_caching_hash_algo(self) -> str:
        # kvferry's own algorithm has no vLLM name: report vLLM's default, as before.
        algo = self._wrapped.prefix_caching_hash_algo
        return "sha256" if algo == "kvferry" else algo

    num_cpu_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    sliding_window: int | None = None


class ParallelConfig(_View):
    def __init__(self, parallel_config: KvferryParallelConfig) -> None:
        self._wrapped = parallel_config

    @property
    def tensor_parallel_size(self) -> int:
        return self._wrapped.tensor_parallel_size

    @property
    def world_size(self) -> int:
        return self._wrapped.tensor_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        return self._wrapped.tensor_parallel_size

    # One engine process: the config's own rank is the driver's; workers learn theirs from
    # vllm.distributed.parallel_state.
    rank = 0
    pipeline_parallel_size = 1
    data_parallel_size = 1
    data_parallel_rank = 0
    data_parallel_rank_local = 0
    decode_context_parallel_size = 1
    prefill_context_parallel_size = 1
    enable_expert_parallel = False


class SchedulerConfig(_View):
    def __init__(self, scheduler_config: KvferrySchedulerConfig, max_model_len: int) -> None:
        self._wrapped = scheduler_config
        self._max_model_len = max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self._wrapped.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self._wrapped.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def enable_chunked_prefill(self) -> bool:
        return self._wrapped.enable_chunked_prefill

    chunked_prefill_enabled = enable_chunked_prefill
    async_scheduling = False


class DeviceConfig(_View):
    def __init__(self, device_config: KvferryDeviceConfig) -> None:
        self._wrapped = device_config

    @property
    def device(self) -> torch.device:
        return self._wrapped.torch_device

    @property
    def device_type(self) -> str:
        return self._wrapped.torch_device.type


class VllmConfig(_View):
    """The engine's configuration as a vLLM connector reads it (``vllm_config.*_config``).

    ``engine_config`` is kvferry's ``EngineConfig`` behind the view. ``kv_transfer_config`` is
    kvferry's own ``KVTransferConfig`` (same names as vLLM's), ``kv_events_config`` the
    engine's own ``KVEventsConfig``.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self._wrapped = engine_config
        self.model_config = ModelConfig(engine_config.model_config)
        self.cache_config = CacheConfig(engine_config.cache_config)
        self.parallel_config = ParallelConfig(engine_config.parallel_config)
        self.scheduler_config = SchedulerConfig(
            engine_config.scheduler_config, engine_config.model_config.max_len
        )
        self.device_config = DeviceConfig(engine_config.device_config)
        self.additional_config: dict[str, Any] = {}

    @classmethod
    def of(cls, config: EngineConfig | VllmConfig) -> VllmConfig:
        return config if isinstance(config, VllmConfig) else cls(config)

    @property
    def engine_config(self) -> EngineConfig:
        return self._wrapped

    @property
    def kv_transfer_config(self) -> KVTransferConfig | None:
        return self._wrapped.kv_transfer_config

    @property
    def kv_events_config(self) -> KVEventsConfig:
        return self._wrapped.kv_events_config

    def compute_hash(self) -> str:
        return f"{self.model_config.model}:{self.cache_config.block_size}"
