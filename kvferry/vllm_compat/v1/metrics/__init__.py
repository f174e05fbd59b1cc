"""``vllm.v1.metrics``: metric helpers connectors import."""
