"""OffloadConnectorBase: the protocol facade both offload connectors share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import CacheHitSource, KVConnectorRole, SupportsHMA
from kvferry.kv_transfer.connectors.offloading.layout import engine_facts
from kvferry.kv_transfer.connectors.offloading.scheduler import OffloadingConnectorScheduler
from kvferry.kv_transfer.connectors.offloading.worker import OffloadingConnectorWorker
from kvferry.kv_transfer.connectors.split import SplitConnector

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.request import Request


class OffloadConnectorBase(
    SplitConnector[OffloadingConnectorScheduler, OffloadingConnectorWorker], SupportsHMA
):
    """A :class:`SplitConnector` over an :class:`OffloadingConnectorScheduler` (or a preset of
    it) and an :class:`OffloadingConnectorWorker`; needs prefix caching, as offloaded KV is
    keyed by block hashes.

    Offload connectors never delay frees (``request_finished`` returns False): a store that
    still reads a finished or preempted request's blocks is *fenced* instead. The scheduler
    half lists, each step, the store jobs whose source blocks this step reallocated; the
    worker waits for them in ``handle_preemptions``, before the forward can overwrite them.

    Hybrid models (``SupportsHMA``): every KV cache group's copy of a chunk is offloaded
    under its own key (see :mod:`~kvferry.kv_transfer.connectors.offloading.groups`).

    External hits come from host memory, or for a tiered connector with a disk tier from the
    tier each chunk is read from (the scheduler half splits them).

    With the engine's KV cache events on (``kv_events_config``), ``take_events()`` reports
    what the tiers gain and lose (host ``CPU``, disk ``STORAGE``).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.facts = engine_facts(config)
        if not self.facts.prefix_caching:
            raise ConfigError(
                f"{type(self).__name__} keys offloaded KV by prefix-cache block hashes and "
                f"needs prefix caching; enable it (enable_prefix_caching=True) or drop the "
                f"connector"
            )
        events = getattr(config, "kv_events_config", None)
        self._kv_events = bool(events is not None and events.publishes)

    def set_scheduler_half(self, half: OffloadingConnectorScheduler) -> None:
        super().set_scheduler_half(half)
        if self._kv_events:
            half.enable_kv_events()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def check_offload_integrity(self, idle: bool = False) -> None:
        """Leak check of the offload pool (scheduler role); see
        :meth:`OffloadingConnectorScheduler.check_integrity`."""
        self._scheduler_side("check_offload_integrity").check_integrity(idle)
