"""``vllm.distributed.kv_transfer``: the KV connector API."""
