"""The benchmarks' shared harness: one module per concern, imported by the scripts in
``benchmarks/``. Heavy imports (torch, psutil, matplotlib, kvferry) happen inside the
functions that use them, so that importing a module stays cheap.

* ``paths``: where results, models, scratch files and docs live;
* ``machine``: facts about the machine a result depends on (CPU model and flags, load);
* ``compute``: linear-layer FLOPs of a model and this machine's GEMM rate (compute floors);
* ``bandwidth``: weight bytes per forward pass and this machine's copy bandwidth (bandwidth
  floors); ``roofline``: a row's schedule with each pass at the slower of the two;
* ``prompts``: deterministic token-id prompts and output lengths;
* ``launch``: running a child process with its wall time, peak RSS and others' CPU use;
* ``timing``: alternating run order and best-of repetitions;
* ``results``: result files (JSON under ``.bench/results``);
* ``markdown``: tables and the generated blocks of ``docs/benchmarks.md``;
* ``plots``: bar and line charts (matplotlib);
* ``cli``: quick-run defaults of the command lines;
* ``models``: the random-weight benchmark models (``tiny``, ``mid``, ``qwen3-0.6b``);
* ``revision_build``: a C kernel built from a git revision's sources, and paired decode
  steps of an engine with two builds taking turns (the ``*_ab.py`` scripts);
* ``engines``: in-process kvferry engines; ``kv_configs``: the KV-transfer configs compared;
* ``serving``: ``kvferry serve`` / ``proxy`` processes and a streaming client;
* ``vllm_env``: vLLM's CPU venv and the runtime environment its runs need;
* ``vllm_cli``, ``vllm_server``, ``bench_serve``, ``quiet``, ``serving_plan``, ``serving_report``: the serving
  benchmark (vLLM's CLI, both servers, ``vllm bench serve`` runs, the quiet-machine checks,
  its report);
* ``throughput``: the pieces of ``benchmarks/throughput.py`` (rows, backends, report).
"""
