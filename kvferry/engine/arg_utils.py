"""EngineArgs: the engine's settings as flat fields, one per CLI flag.

``EngineArgs`` is what users pass to ``LLM(...)`` as keyword arguments and what
``kvferry generate`` / ``kvferry serve`` parse from flags (field ``max_num_seqs`` is flag
``--max-num-seqs``). ``create_engine_config`` turns it into the validated ``EngineConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from kvferry.config import (
    PREFIX_CACHING_HASH_ALGOS,
    CacheConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(value: str | int | float) -> int:
    """Bytes from ``123``, ``512MiB``, ``2GB`` or ``1.5GiB``."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if not m:
        raise ConfigError(f"cannot parse size {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = unit[:1]
    mult = 1024 ** "bkmgt".index(base) if "i" in unit and base in "kmgt" else _UNITS[base]
    return int(num * mult)


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass
class EngineArgs:
    model: str = field(metadata=_help("local Hugging Face model folder (Llama/Qwen2/Qwen3)"))
    tokenizer: str | None = field(default=None, metadata=_help("tokenizer folder (default: model)"))
    dtype: str = field(default="auto", metadata=_help("auto, float32, bfloat16 or float16"))
    max_model_len: int | None = field(
        default=None, metadata=_help("max prompt+output tokens (default: model's limit)")
    )
    seed: int = field(default=0, metadata=_help("seed for unseeded random sampling"))
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda[:N]"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    enable_prefix_caching: bool = field(default=True, metadata=_help("reuse KV of shared prefixes"))
    kv_cache_memory: str | int | None = field(
        default=None, metadata=_help("bytes for the KV pool, e.g. 2GiB (default: auto)")
    )
    num_kv_blocks: int | None = field(
        default=None, metadata=_help("exact number of KV blocks (overrides --kv-cache-memory)")
    )
    prefix_caching_hash_algo: str = field(
        default="kvferry",
        metadata=_help(
            "block hash: kvferry (canonical SHA-256) or vLLM's "
            + ", ".join(PREFIX_CACHING_HASH_ALGOS[1:])
        ),
    )
    kv_pool_prefault: bool = field(
        default=True,
        metadata=_help(
            "take every page of a CPU KV pool at start-up (the default), not on each block's"
            " first use (KVFERRY_KV_POOL_PREFAULT=1/0, when set, decides)"
        ),
    )
    max_num_batched_tokens: int = field(default=2048, metadata=_help("token budget per step"))
    max_num_seqs: int = field(default=128, metadata=_help("max requests per step"))
    enable_chunked_prefill: bool = field(
        default=True, metadata=_help("split long prefills across steps")
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("tensor-parallel worker processes (model heads must divide by it)"),
    )
    log_stats: bool = field(default=False, metadata=_help("log engine stats periodically"))
    kv_transfer_config: str | dict[str, Any] | KVTransferConfig | None = field(
        default=None,
        metadata=_help(
            "KV connector settings as JSON, e.g. "
            '\'{"kv_connector":"ExampleConnector","kv_role":"kv_both"}\''
        ),
    )

    kv_events_config: str | dict[str, Any] | KVEventsConfig | None = field(
        default=None,
        metadata=_help(
            "KV cache event publishing as JSON (vLLM's fields), e.g. "
            '\'{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:5557"}\''
        ),
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        for f in dataclasses.fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.name == "model" and positional_model:
                parser.add_argument("model", help=help_text)
                continue
            if f.type in ("bool", bool):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
                continue
            kind: Any = str
            if f.type in ("int", "int | None"):
                kind = int
            required = f.default is dataclasses.MISSING
            default = None if required else f.default
            parser.add_argument(flag, type=kind, default=default, required=required, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"unknown engine argument(s) {unknown}; valid ones are {sorted(names)}"
            )
        return cls(**kwargs)

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        value = self.kv_transfer_config
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            return KVTransferConfig.from_json(value)
        return KVTransferConfig.from_dict(value)

    def _kv_events_config(self) -> KVEventsConfig:
        value = self.kv_events_config
        if value is None:
            return KVEventsConfig()
        if isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            return KVEventsConfig.from_json(value)
        return KVEventsConfig.from_dict(value)

    def create_engine_config(self) -> EngineConfig:
        kv_mem = None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=kv_mem,
                num_kv_blocks=self.num_kv_blocks,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                kv_pool_prefault=self.kv_pool_prefault,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            device_config=DeviceConfig(device=self.device),
            kv_transfer_config=self._kv_transfer_config(),
            kv_events_config=self._kv_events_config(),
            log_stats=self.log_stats,
        )
