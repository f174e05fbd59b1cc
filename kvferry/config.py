"""Typed engine configuration. Every check on user-supplied settings lives here.

Each config raises :class:`ConfigError` with one clear sentence on bad input, so the CLI and
the offline API can show it without a traceback from deep inside the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class ConfigError(ValueError):
    """A user-facing configuration error; the message is meant to be shown as is."""


@dataclass(frozen=True)
class ArchConfig:
    """The parts of a Hugging Face ``config.json`` the engine needs, typed and checked."""

    family: str  # "llama" | "qwen2" | "qwen3"
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json") -> ArchConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"kvferry supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def req(key: str) -> Any:
            if key not in raw:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return raw[key]

        def size(key: str, default: int | None = None) -> int:
            value = req(key) if default is None else (raw.get(key) or default)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        if not raw.get("head_dim") and hidden < heads:
            raise ConfigError(
                f"{source}: hidden_size ({hidden}) is smaller than num_attention_heads ({heads})"
            )
        head_dim = size("head_dim", hidden // heads)
        if heads % kv_heads != 0:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if head_dim % 2:
            derived = "" if raw.get("head_dim") else f" (hidden_size {hidden} // {heads} heads)"
            raise ConfigError(
                f"{source}: head_dim {head_dim}{derived} is odd, but rotary position "
                f"embeddings need an even head_dim"
            )
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        if isinstance(rope_scaling, dict):
            rope_theta = rope_theta or rope_scaling.get("rope_theta")
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise ConfigError(f"{source}: unsupported rope_scaling type {rtype!r}")
            if rtype == "default":
                rope_scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        default_bias = family == "qwen2"
        return ArchConfig(
            family=family,
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_hidden_layers=size("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=size("vocab_size"),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling if isinstance(rope_scaling, dict) else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


def resolve_dtype(name: str, arch_dtype: str | None) -> torch.dtype:
    if name == "auto":
        if arch_dtype in _DTYPES:
            # bf16/fp16 checkpoints run in their own dtype; on CPU fp16 matmuls are slow and
            # inaccurate, so "auto" picks bf16 there.
            dt = _DTYPES[arch_dtype]
            return torch.bfloat16 if dt == torch.float16 and not torch.cuda.is_available() else dt
        return torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


@dataclass
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    arch: ArchConfig = field(init=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.exists():
            raise ConfigError(f"model folder {self.model!r} does not exist")
        if not path.is_dir():
            raise ConfigError(
                f"model {self.model!r} is not a folder (expected a Hugging Face checkpoint folder)"
            )
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"model folder {self.model!r} has no config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_path} must hold a JSON object")
        self.arch = ArchConfig.from_dict(raw, str(cfg_path))
        if not any(path.glob("*.safetensors")):
            raise ConfigError(f"model folder {self.model!r} has no *.safetensors weights")
        self.torch_dtype = resolve_dtype(self.dtype, self.arch.torch_dtype)
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        elif self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if self.tokenizer is None:
            self.tokenizer = self.model

    @property
    def max_len(self) -> int:
        assert self.max_model_len is not None
        return self.max_model_len


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set

    def __post_init__(self) -> None:
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
        if self.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size > 1 is not supported yet")


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
    log_stats: bool = False

    def __post_init__(self) -> None:
        sc, mc = self.scheduler_config, self.model_config
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < mc.max_len:
            raise ConfigError(
                f"with chunked prefill off, max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) must be >= max_model_len ({mc.max_len})"
            )
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


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


def check_kv_load_failure_policy(policy: str) -> None:
    if policy not in KV_LOAD_FAILURE_POLICIES:
        raise ConfigError(
            f"kv_load_failure_policy {policy!r} is not one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
        )


@dataclass
class KVTransferConfig:
    """Turns on a KV connector and configures it (names and defaults as in vLLM)."""

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        import uuid

        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_connector is not None and self.kv_role is None:
            raise ConfigError(
                f"kv_role is required with kv_connector={self.kv_connector!r}; "
                f"use one of {', '.join(KV_ROLES)}"
            )
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role {self.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        check_kv_load_failure_policy(self.kv_load_failure_policy)
        if self.kv_connector_module_path == "":
            raise ConfigError("kv_connector_module_path must not be empty")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        if not 0 < self.kv_port < 65536:
            raise ConfigError(f"kv_port must be a TCP port, got {self.kv_port}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferConfig:
        import dataclasses

        if not isinstance(data, dict):
            raise ConfigError("the KV transfer config must be a JSON object")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown KV transfer config key(s) {unknown}; valid keys are {valid}"
            )
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"bad KV transfer config: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-transfer-config is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)
