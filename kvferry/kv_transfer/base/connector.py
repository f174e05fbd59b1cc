"""``KVConnectorBase`` (alias ``KVConnectorBase_V1``): one class with both roles' contracts,
its constructor and class-level hooks; ``SupportsHMA`` for connectors of several KV groups."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.base.common import KVConnectorRole
from kvferry.kv_transfer.base.scheduler_side import KVConnectorSchedulerSide
from kvferry.kv_transfer.base.worker_side import KVConnectorWorkerSide
from kvferry.kv_transfer.kv_cache_view import KVCacheManagerView
from kvferry.logger import init_logger
from kvferry.step_types.kv_connector_metadata import KVConnectorMetadata

if TYPE_CHECKING:
    from kvferry.config import EngineConfig, KVTransferConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.base.prom import KVConnectorPromMetrics, PromMetric
    from kvferry.request import Request

__all__ = ["KVConnectorBase", "KVConnectorBase_V1", "SupportsHMA", "supports_hma"]

logger = init_logger(__name__)


class KVConnectorBase(KVConnectorSchedulerSide, KVConnectorWorkerSide, ABC):
    """Base of every KV connector. Subclasses implement the abstract methods of their roles.

    The constructor takes ``(vllm_config, role, kv_cache_config=None)``, positionally or by
    keyword: the engine config (``kv_transfer_config`` set), the role, and the KV pool layout.
    The factory calls ``cls(config, role, kv_cache_config)``; a subclass may name its
    parameters as it likes, or take ``*args, **kwargs`` and pass them on, but must accept a
    third argument (a 2-argument constructor is refused). The base keeps the config as
    ``self._vllm_config`` (also ``self._config``), ``self._kv_transfer_config`` and
    ``self._kv_cache_config``. Only the methods of the instance's role are ever called on it.
    """

    def __init__(
        self,
        vllm_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        kvt = getattr(vllm_config, "kv_transfer_config", None)
        if kvt is None:
            raise ValueError("a KV connector needs the engine config's kv_transfer_config")
        self._vllm_config = vllm_config
        self._config = vllm_config
        self._kv_transfer_config: KVTransferConfig = kvt
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager: KVCacheManagerView | None = None
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None
        self._copy_op = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The KV layout the connector needs (``"NHD"`` or ``"HND"``), or None for any.
        Asked at start, before the KV pool is allocated: the pool is laid out as asked
        (default ``"NHD"``; ``KVFERRY_KV_CACHE_LAYOUT`` overrides when it agrees). Either way
        ``register_kv_caches`` gets tensors of FlashAttention's logical shape ``(2,
        num_blocks, block_size, kv_heads, head_dim)``; with ``"HND"`` their strides put each
        head's rows of a block together (see :mod:`kvferry.kv_layout`). vLLM 0.33's
        ``"LBNHC"`` and ``"LBHNC"`` are taken as ``"NHD"`` and ``"HND"``; any other name is
        refused with a clear error. Raises on the base."""
        if cls is KVConnectorBase:
            raise TypeError("get_required_kvcache_layout is asked of a connector class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True when the connector relies on the per-layer Python hooks under CUDA graphs.
        kvferry runs eagerly and never asks (vLLM's default False)."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether the connector follows vLLM's sleep-mode KV remap. kvferry has no sleep
        mode and never asks; vLLM's default True."""
        return True

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The connector's own Prometheus metrics, or None. The server calls it once at start
        and serves what it registers on ``/metrics``; each step's stats reach its ``observe``
        (see :mod:`kvferry.kv_transfer.base.prom`)."""
        return None


KVConnectorBase_V1 = KVConnectorBase


class SupportsHMA(ABC):
    """Mixin for connectors that handle several KV cache groups (hybrid models)."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with one block-id list per KV cache group."""


def supports_hma(connector: object) -> bool:
    cls = connector if isinstance(connector, type) else type(connector)
    return issubclass(cls, SupportsHMA)
