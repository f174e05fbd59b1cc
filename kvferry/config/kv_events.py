"""KVEventsConfig: whether and where the engine publishes its KV cache events (vLLM's fields)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvferry.config.errors import ConfigError
from kvferry.config.json_object import from_json_object, parse_json

KV_EVENT_PUBLISHERS = ("null", "zmq")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_endpoint(name: str, value: str) -> None:
    if not isinstance(value, str) or not value.startswith(_ENDPOINT_SCHEMES):
        raise ConfigError(
            f"kv_events_config.{name} must be a ZMQ endpoint such as tcp://127.0.0.1:5557, "
            f"got {value!r}"
        )


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields and meanings.

    One difference from vLLM, on purpose: the default ``endpoint`` binds 127.0.0.1, not
    every interface (``tcp://*:5557``); publishing to the network is something an operator
    configures. An endpoint with ``*`` or a local address is bound, any other host is
    connected to (the subscriber binds), as in vLLM.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ConfigError(
                f"kv_events_config.publisher {self.publisher!r} is not one of "
                f"{', '.join(KV_EVENT_PUBLISHERS)}"
            )
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"kv_events_config.{name} must be an integer >= 0, got {value!r}")
        if self.max_queue_size == 0:
            raise ConfigError("kv_events_config.max_queue_size must be at least 1")
        if not isinstance(self.topic, str):
            raise ConfigError("kv_events_config.topic must be a string")

    @property
    def publishes(self) -> bool:
        """True when events are collected and sent (enabled, with a real publisher)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        return from_json_object(cls, data, "kv_events_config")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        return cls.from_dict(parse_json(text, "--kv-events-config"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
