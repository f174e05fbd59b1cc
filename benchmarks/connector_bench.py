"""KV-connector protocol costs and gains, measured side by side in one process.

1. Overhead: engine throughput with a connector configured but no hits (every prompt unique)
   vs no connector. Configurations run interleaved, several rounds, median reported.
   Target: <= 2% loss.
2. TTFT of a 2k-token prompt on the ~140M model: ExampleConnector hit (a fresh engine, empty
   local prefix cache, on a folder that holds the prompt) vs recompute. Target: hit >= 5x.

    .venv/bin/python benchmarks/connector_bench.py            # full run
    .venv/bin/python benchmarks/connector_bench.py --quick    # smoke run on the tiny model
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.engines import make_llm
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.prompts import make_prompts
from benchmarks.harness.results import result_path, run_header, write_json

EXAMPLES = str(REPO_ROOT)
ENGINE_ARGS = {"max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def _engine(model: Path, dtype: str, kv: dict[str, Any] | None) -> Any:
    return make_llm(model, dtype, kv, **ENGINE_ARGS)


def _throughput(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from kvferry import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def overhead(model: Path, dtype: str, num: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    sys.path.insert(0, EXAMPLES)
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-bench-"))
    configs: dict[str, dict[str, Any] | None] = {
        "none": None,
        "ExampleConnector (stores every prompt to disk)": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
        },
        "HostPrefixConnector (README example, host memory)": {
            "kv_connector": "HostPrefixConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "examples.host_prefix_connector",
            "kv_connector_extra_config": {"max_blocks": 100000},
        },
    }
    engines = {name: _engine(model, dtype, kv) for name, kv in configs.items()}
    vocab = model_vocab_size(model)
    for llm in engines.values():  # warm-up
        _throughput(llm, make_prompts(4, vocab, seed=999), 4)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        prompts = make_prompts(num, vocab, seed=1000 + r)  # fresh ids: no hits anywhere
        for name, llm in engines.items():
            llm.engine.scheduler.reset_prefix_cache()
            samples[name].append(_throughput(llm, prompts, max_tokens))
    shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(samples["none"])
    rows = {
        name: {
            "tok_s": statistics.median(s),
            "samples": s,
            "loss_pct": 100 * (1 - statistics.median(s) / base),
        }
        for name, s in samples.items()
    }
    return {
        "dtype": dtype,
        "num_prompts": num,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "rows": rows,
    }


def ttft(model: Path, dtype: str, prompt_len: int, repeats: int) -> dict[str, Any]:
    from kvferry import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = model_vocab_size(model)
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-ttft-"))
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp)},
    }
    recompute: list[float] = []
    hit: list[float] = []
    external: list[int] = []
    writer = _engine(model, dtype, kv)
    writer.generate([{"prompt_token_ids": [5] * 32}], params, use_tqdm=False)  # warm-up
    reader = _engine(model, dtype, kv)
    reader.generate([{"prompt_token_ids": [6] * 32}], params, use_tqdm=False)
    for r in range(repeats):
        prompt = make_prompts(1, vocab, seed=2000 + r, min_len=prompt_len, max_len=prompt_len)[0]
        t0 = time.perf_counter()
        writer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        recompute.append(time.perf_counter() - t0)
        reader.engine.scheduler.reset_prefix_cache()
        t0 = time.perf_counter()
        out = reader.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        hit.append(time.perf_counter() - t0)
        external.append(out[0].metrics.num_external_cached_tokens)
    shutil.rmtree(tmp, ignore_errors=True)
    rec, h = statistics.median(recompute), statistics.median(hit)
    return {
        "dtype": dtype,
        "prompt_len": prompt_len,
        "recompute_s": rec,
        "hit_s": h,
        "speedup": rec / h,
        "external_tokens": external,
        "samples": {"recompute": recompute, "hit": hit},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, small sizes")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model = get_model("tiny" if args.quick else "mid")
    num, max_tokens, plen = (8, 16, 512) if args.quick else (32, 64, 2048)
    result = {
        **run_header(),
        "model": model.name,
        "overhead": overhead(model, args.dtype, num, max_tokens, 2 if args.quick else args.rounds),
        "ttft": ttft(model, args.dtype, plen, 2 if args.quick else 3),
    }
    out = write_json(result_path("connector", args.quick), result)
    ov = result["overhead"]
    print(
        f"## Connector overhead, no hits ({model.name}, {ov['dtype']}, {ov['num_prompts']} "
        f"prompts x {ov['max_tokens']} tokens, median of {ov['rounds']} interleaved rounds)\n"
    )
    print(
        markdown_table(
            ["connector", "output tok/s", "loss vs none"],
            [[n, f"{r['tok_s']:.1f}", f"{r['loss_pct']:+.1f}%"] for n, r in ov["rows"].items()],
        )
    )
    t = result["ttft"]
    print(f"\n## TTFT, {t['prompt_len']}-token prompt ({model.name}, {t['dtype']})\n")
    print(
        markdown_table(
            ["path", "TTFT (s)"],
            [
                ["recompute", f"{t['recompute_s']:.3f}"],
                ["ExampleConnector hit", f"{t['hit_s']:.3f}"],
                ["speedup", f"{t['speedup']:.1f}x"],
            ],
        )
    )
    print(f"\nexternal tokens per hit: {t['external_tokens']}; results: {out}")


if __name__ == "__main__":
    main()
