"""MultiConnector's configuration: each child's engine config, and the class-level hooks
(asked before any instance exists) answered from the children's classes."""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    supports_hma,
)
from kvferry.kv_transfer.connectors.multi_stats import (
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
    child_stats_class_by_name,
    split_child_keys,
)
from kvferry.kv_transfer.factory import KVConnectorFactory

if TYPE_CHECKING:
    from kvferry.config import EngineConfig

__all__ = ["MultiClassHooks", "child_configs"]


def child_configs(config: EngineConfig) -> list[EngineConfig]:
    kvt = config.kv_transfer_config
    assert kvt is not None
    children = kvt.kv_connector_extra_config.get("connectors")
    if not isinstance(children, list) or not children:
        raise ConfigError(
            "MultiConnector needs kv_connector_extra_config.connectors: a non-empty list"
        )
    extra = sorted(set(kvt.kv_connector_extra_config) - {"connectors"})
    if extra:
        raise ConfigError(
            f"MultiConnector: unknown option(s) {extra}; valid options are ['connectors']"
        )
    out = []
    for i, child in enumerate(children):
        if not isinstance(child, dict):
            raise ConfigError(f"MultiConnector: connectors[{i}] must be a JSON object")
        data = {
            "engine_id": kvt.engine_id,
            "kv_role": kvt.kv_role,
            "kv_load_failure_policy": kvt.kv_load_failure_policy,
            **child,
        }
        child_kvt = KVTransferConfig.from_dict(data)
        if child_kvt.kv_connector == "MultiConnector":
            raise ConfigError("MultiConnector cannot contain another MultiConnector")
        if dataclasses.is_dataclass(config):
            out.append(dataclasses.replace(config, kv_transfer_config=child_kvt))
        else:  # a partial config (tests)
            partial = copy.copy(config)
            partial.kv_transfer_config = child_kvt
            out.append(partial)
    return out


class MultiClassHooks:
    """The MultiConnector's classmethods: each child class asked with its own config."""

    @classmethod
    def supports_hma_config(cls, kvt: KVTransferConfig) -> bool:
        children = kvt.kv_connector_extra_config.get("connectors") or []
        return all(
            supports_hma(
                KVConnectorFactory.get_connector_class(
                    KVTransferConfig.from_dict({"kv_role": kvt.kv_role, **c})
                )
            )
            for c in children
        )

    @classmethod
    def _child_classes(cls, config: EngineConfig) -> list[tuple[type[KVConnectorBase], Any]]:
        return [
            (KVConnectorFactory.get_connector_class(c.kv_transfer_config), c)  # type: ignore[arg-type]
            for c in child_configs(config)
        ]

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Names compared as the factory reads them (any case, surrounding spaces).
        layouts = {
            str(layout).strip().upper()
            for child_cls, child_config in cls._child_classes(vllm_config)
            if (layout := child_cls.get_required_kvcache_layout(child_config)) is not None
        }
        if len(layouts) > 1:
            raise ConfigError(f"MultiConnector children require different KV layouts: {layouts}")
        return layouts.pop() if layouts else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return any(
            KVConnectorFactory.get_connector_class(
                KVTransferConfig.from_dict({"kv_role": "kv_both", **c})
            ).requires_piecewise_for_cudagraph(c.get("kv_connector_extra_config", {}))
            for c in extra_config.get("connectors") or []
        )

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        by_class: dict[type[KVConnectorBase], KVConnectorPromMetrics | None] = {}
        children: dict[str, KVConnectorPromMetrics] = {}
        for i, (child_cls, child_config) in enumerate(cls._child_classes(vllm_config)):
            if child_cls not in by_class:  # a class registers its metric names once
                by_class[child_cls] = child_cls.build_prom_metrics(
                    child_config, metric_types, labelnames, per_engine_labelvalues
                )
            if (prom := by_class[child_cls]) is not None:
                children[f"{i}.{child_cls.__name__}"] = prom
        if not children:
            return None
        return MultiKVConnectorPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, children
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        by_child: dict[str, KVConnectorStats] = {}
        for name, child_data in split_child_keys(data or {}).items():
            child_cls = child_stats_class_by_name(name.partition(".")[2]) if name else None
            built = child_cls.build_kv_connector_stats(child_data) if child_cls else None
            by_child[name] = built if built is not None else KVConnectorStats(child_data)
        return MultiKVConnectorStats(by_child=by_child)
