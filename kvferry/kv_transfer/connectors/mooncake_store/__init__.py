"""MooncakeStoreConnector: prompt KV shared across engines through a Mooncake Store.

``connector.py`` (the split-connector facade), ``scheduler.py`` with ``lookups.py`` (async
lookups, plans, delayed frees, events), ``worker.py`` with ``transfer.py`` (the transfer
threads and the staging buffer), ``metadata.py`` (what passes between the halves),
``layout.py``, ``options.py`` and ``stats.py``. The storage mechanism (config, client, keys,
value format, a local master) is :mod:`kvferry.kv_transfer.stores`."""

from kvferry.kv_transfer.connectors.mooncake_store.connector import MooncakeStoreConnector

__all__ = ["MooncakeStoreConnector"]
