"""``vllm.v1``: the engine-core types connectors read."""
