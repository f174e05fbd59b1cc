"""``vllm.config.kv_events``: kvferry's ``KVEventsConfig`` (vLLM's fields and meanings).

One difference from vLLM: the default ``endpoint`` is ``tcp://127.0.0.1:5557``, not
``tcp://*:5557`` (see ``kvferry.config.kv_events``).
"""

from kvferry.config.kv_events import KVEventsConfig

__all__ = ["KVEventsConfig"]
