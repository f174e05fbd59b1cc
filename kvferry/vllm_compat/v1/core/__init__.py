"""``vllm.v1.core``: the scheduler-side types connectors read."""
