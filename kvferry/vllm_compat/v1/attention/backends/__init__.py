"""``vllm.v1.attention.backends``: the attention-backend helpers connectors import."""
