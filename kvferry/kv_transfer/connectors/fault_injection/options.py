"""The FaultInjectionConnector's options (``kv_connector_extra_config``) and the wrapped
connector's KV transfer config.

``inner`` (required): the wrapped connector, by name (``"OffloadingConnector"``) or as a KV
transfer config object (``{"kv_connector": ..., "kv_connector_module_path": ...,
"kv_connector_extra_config": {...}}``); other KV transfer fields default to this connector's.

A *load* is one request's external hit (counted in the order the scheduler admits them, from
0); a *store* is one request's newly completed blocks in one step (in step order, from 0).
``fail_loads`` / ``corrupt_loads`` / ``fail_stores``: indexes of those to sabotage;
``fail_load_rate`` / ``corrupt_load_rate`` / ``fail_store_rate``: the probability that any
other one is (drawn from a generator seeded with ``seed``, default 0, so runs repeat).
``delay_loads_s`` / ``delay_stores_s``: how long to delay, applied to the indexes in
``delay_loads`` / ``delay_stores`` or, when those are not given, to every load / store.
``raise_in``: a hook name (e.g. ``"start_load_kv"``, ``"get_num_new_matched_tokens"``);
``raise_calls``: which calls of it raise (0-based; default: every call).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError, KVTransferConfig

if TYPE_CHECKING:
    from kvferry.config import EngineConfig

# The hooks ``raise_in`` may name.
HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "register_kv_caches",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "finish_forward",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


class InjectedFault(RuntimeError):
    """Raised by the hook named in ``raise_in``."""


@dataclass
class FaultInjectionOptions:
    inner: Any = None
    fail_loads: list[int] = field(default_factory=list)
    corrupt_loads: list[int] = field(default_factory=list)
    fail_load_rate: float = 0.0
    corrupt_load_rate: float = 0.0
    delay_loads_s: float = 0.0
    delay_loads: list[int] | None = None
    fail_stores: list[int] = field(default_factory=list)
    fail_store_rate: float = 0.0
    delay_stores_s: float = 0.0
    delay_stores: list[int] | None = None
    seed: int = 0
    raise_in: str | None = None
    raise_calls: list[int] | None = None

    def validate(self, owner: str) -> None:
        if not isinstance(self.inner, (str, dict)) or not self.inner:
            raise ConfigError(
                f"{owner}: set inner to the wrapped connector's name or KV transfer config"
            )
        lists = ("fail_loads", "corrupt_loads", "delay_loads", "fail_stores", "delay_stores")
        for name in (*lists, "raise_calls"):
            value = getattr(self, name)
            if value is not None and not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
            ):
                raise ConfigError(f"{owner}: {name} must be a list of indexes >= 0")
        for name in ("fail_load_rate", "corrupt_load_rate", "fail_store_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{owner}: {name} must be between 0 and 1")
        for name in ("delay_loads_s", "delay_stores_s"):
            if not 0.0 <= getattr(self, name) < 3600:
                raise ConfigError(f"{owner}: {name} must be >= 0 seconds")
        if self.raise_in is not None and self.raise_in not in HOOKS:
            raise ConfigError(f"{owner}: raise_in must be one of {list(HOOKS)}")


def inner_config(kvt: KVTransferConfig, owner: str) -> KVTransferConfig:
    """The wrapped connector's KV transfer config: ``inner`` over this one's fields."""
    inner = kvt.kv_connector_extra_config.get("inner")
    if isinstance(inner, str):
        child: dict[str, Any] = {"kv_connector": inner}
    elif isinstance(inner, dict):
        child = dict(inner)
    else:
        raise ConfigError(f"{owner}: inner must be a connector name or a KV transfer config")
    base = {f.name: getattr(kvt, f.name) for f in dataclasses.fields(kvt)}
    base.update(kv_connector=None, kv_connector_module_path=None, kv_connector_extra_config={})
    config = KVTransferConfig.from_dict({**base, **child})
    if not config.kv_connector:
        raise ConfigError(f"{owner}: inner needs a kv_connector")
    return config


def with_kv_transfer_config(config: EngineConfig, kvt: KVTransferConfig) -> EngineConfig:
    """``config`` with ``kvt`` as its KV transfer config (for building the wrapped connector)."""
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, kv_transfer_config=kvt)
    child = copy.copy(config)  # a partial config (tests)
    child.kv_transfer_config = kvt
    return child
