"""``vllm.v1.attention``: attention metadata."""
