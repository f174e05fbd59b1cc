"""One benchmark run of one backend, in its own process (spawned by throughput.py).

    python benchmarks/worker.py JOB.json RESULT.json

The job names the backend ("kvferry", "hf", "vllm" or "vllm-compile"), the model, dtype,
prompts (token ids), per-request output lengths and engine limits. The worker loads the
backend, serves a 1-request warm-up, optionally runs the job's batch shape once on other
token ids (``warmup: "full"``), then times ``generate`` over all requests and writes a
result JSON: timings, output token ids (for the agreement check) and its own peak RSS.

This file must run in the project venv (kvferry, transformers) and in vLLM's venv
(``.bench/vllm-venv``), so it imports nothing from the project at module level and
nothing but the standard library before the backend is chosen.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

Job = dict[str, Any]
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]


def _warmup_prompt(vocab_size: int, length: int = 32) -> list[int]:
    # Distinct from the benchmark prompts so that no prefix cache can reuse it.
    rng = random.Random("warmup")
    return [rng.randrange(5, vocab_size) for _ in range(length)]


def _shadow_prompts(
    prompts: list[list[int]], vocab_size: int, seed: str = "warmup-full"
) -> list[list[int]]:
    """Prompts with the same lengths as ``prompts`` but other (random) token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in p] for p in prompts]


# ---------------------------------------------------------------------------
# Backends: each returns (generate function, notes)
# ---------------------------------------------------------------------------


def load_kvferry(job: Job) -> tuple[Generate, list[str]]:
    from kvferry import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        kv_cache_memory=job["kv_cache_bytes"],
        max_model_len=job["max_model_len"],
    )

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, [f"kvferry, LD_PRELOAD={_preloaded()}"]


def load_vllm(job: Job) -> tuple[Generate, list[str]]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        enforce_eager=job.get("vllm_enforce_eager", True),
        enable_prefix_caching=job.get("vllm_prefix_caching", True),
        disable_log_stats=True,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],  # type: ignore[misc]
            params,
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    import vllm

    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
    return generate, [
        f"vllm {vllm.__version__}, engine core {'in a separate process' if mp else 'in-process'}, "
        f"enforce_eager={job.get('vllm_enforce_eager', True)}, "
        f"KV cache {os.environ.get('VLLM_CPU_KVCACHE_SPACE', '?')} GiB, "
        f"LD_PRELOAD={_preloaded()}"
    ]


def load_hf(job: Job) -> tuple[Generate, list[str]]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval()
    # ignore_eos: with no eos_token_id, generate neither stops at nor masks any token, so
    # greedy picks are the plain argmax as in vLLM / kvferry with ignore_eos=True.
    # min_new_tokens=max_new_tokens then pins every sequence to exactly its length.
    model.generation_config.eos_token_id = None
    pad_id = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    batch_size = int(job.get("hf_batch_size") or 0)
    strategy = job.get("hf_mixed_strategy", "sorted")

    def run_batch(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return out[:, width:].tolist()

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        n = len(prompts)
        bs = batch_size if batch_size > 0 else n
        if len(set(max_tokens)) == 1 and bs >= n:
            return run_batch(prompts, max_tokens[0])
        # Mixed lengths: generate() has one max_new_tokens per batch. "sorted" sorts by
        # requested length and generates each batch up to its longest member, then cuts
        # every request to its own length; "padded" runs batches in the given order.
        order = list(range(n))
        if strategy == "sorted":
            order.sort(key=lambda i: max_tokens[i])
        results: list[list[int]] = [[] for _ in range(n)]
        for start in range(0, n, bs):
            idx = order[start : start + bs]
            longest = max(max_tokens[i] for i in idx)
            outs = run_batch([prompts[i] for i in idx], longest)
            for i, toks in zip(idx, outs, strict=True):
                results[i] = toks[: max_tokens[i]]
        return results

    import transformers

    return generate, [
        f"transformers {transformers.__version__}, attn={model.config._attn_implementation}, "
        f"batch={'all' if batch_size <= 0 else batch_size}, mixed strategy={strategy}, "
        f"LD_PRELOAD={_preloaded()}"
    ]


LOADERS: dict[str, Callable[[Job], tuple[Generate, list[str]]]] = {
    "kvferry": load_kvferry,
    "vllm": load_vllm,
    "vllm-compile": load_vllm,
    "hf": load_hf,
}


# As this process was started with (vLLM rewrites os.environ["LD_PRELOAD"] for its children).
_LD_PRELOAD_AT_START = os.environ.get("LD_PRELOAD", "")


def _preloaded() -> str:
    libs = [os.path.basename(p) for p in _LD_PRELOAD_AT_START.split(":") if p]
    return ",".join(libs) or "none"


def peak_rss_bytes() -> int:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) * 1024


def run(job: Job) -> dict[str, Any]:
    result: dict[str, Any] = {"backend": job["backend"], "status": "ok"}
    t_import = time.time()
    try:
        loader = LOADERS[job["backend"]]
        generate, notes = loader(job)
    except ImportError as e:
        return {**result, "status": "unavailable", "error": f"{type(e).__name__}: {e}"}
    t_loaded = time.time()
    result["notes"] = notes
    generate([_warmup_prompt(job["vocab_size"])], [4])
    t_ready = time.time()
    prompts: list[list[int]] = job["prompts"]
    max_tokens: list[int] = job["max_tokens"]
    steady_warmup_s = None
    if job.get("warmup", "full") == "full":
        # Same batch shape (prompt lengths, output lengths), different token ids, so that
        # shape-keyed kernel caches (oneDNN primitives, allocator pools) are warm and no
        # prefix cache can serve the timed run.
        start = time.perf_counter()
        generate(_shadow_prompts(prompts, job["vocab_size"]), max_tokens)
        steady_warmup_s = time.perf_counter() - start
    # Timed runs: the row's prompts first (their outputs are compared across backends), then
    # same-shape prompts with other token ids, so no prefix cache serves a repeat.
    times = []
    outputs: list[list[int]] = []
    for rep in range(max(1, int(job.get("timed_reps", 1)))):
        batch = prompts if rep == 0 else _shadow_prompts(prompts, job["vocab_size"], f"timed-{rep}")
        start = time.perf_counter()
        out = generate(batch, max_tokens)
        times.append(time.perf_counter() - start)
        if rep == 0:
            outputs = out
    gen_s = statistics.median(times)
    result.update(
        startup_s=t_ready - job["t_launch"],
        interpreter_s=t_import - job["t_launch"],
        load_s=t_loaded - t_import,
        warmup_s=t_ready - t_loaded,
        steady_warmup_s=steady_warmup_s,
        gen_s=gen_s,
        gen_s_all=times,
        output_tokens=sum(len(o) for o in outputs),
        expected_output_tokens=sum(max_tokens),
        token_ids=outputs,
        self_peak_rss_bytes=peak_rss_bytes(),
    )
    return result


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip())
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = run(job)
    except Exception as e:  # reported to the parent, which prints it
        result = {
            "backend": job.get("backend"),
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
    with open(result_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    _reap_children()
    # An engine may leave non-daemon threads behind; do not wait for them.
    os._exit(0 if result["status"] != "error" else 1)


def _reap_children() -> None:
    """End helper processes (e.g. vLLM's engine core) before the hard exit below."""
    try:
        import psutil
    except ImportError:
        return
    children = psutil.Process().children(recursive=True)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for c in alive:
        with contextlib.suppress(psutil.Error):
            c.kill()


if __name__ == "__main__":
    sys.exit(main())
