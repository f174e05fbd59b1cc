"""KV connectors written the way vLLM connector authors write them: vLLM import paths, vLLM
constructor styles, vLLM object attributes. Load them by ``kv_connector_module_path`` (their
``vllm`` imports resolve to kvferry's surface when vLLM is not installed); importing them
directly needs ``kvferry.kv_transfer.vllm_imports.install()`` first."""
