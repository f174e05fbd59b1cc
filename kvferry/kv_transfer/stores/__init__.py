"""Shared KV stores: the storage mechanism behind the store connectors, without any connector
protocol. ``mooncake_config`` (how a Mooncake Store client is configured), ``mooncake_client``
(a typed wrapper over ``MooncakeDistributedStore``), ``chunk_key`` (store keys that name a
model, its KV layout and a prefix), ``chunk_codec`` (the checked value format) and ``master``
(a local ``mooncake_master`` process for tests, demos and benchmarks)."""
