"""kvferry: a compact LLM inference engine built around vLLM V1's KV-connector protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.sampling_params import SamplingParams
from kvferry.version import __version__ as __version__

if TYPE_CHECKING:
    from kvferry.config.kv_transfer import KVTransferConfig
    from kvferry.engine.arg_utils import EngineArgs
    from kvferry.engine.llm import LLM

__all__ = ["LLM", "EngineArgs", "KVTransferConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvferry` (e.g. by the CLI's --help) does not load the engine.
    if name == "LLM":
        from kvferry.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from kvferry.engine.arg_utils import EngineArgs

        return EngineArgs
    if name == "KVTransferConfig":
        from kvferry.config.kv_transfer import KVTransferConfig

        return KVTransferConfig
    raise AttributeError(f"module 'kvferry' has no attribute {name!r}")
