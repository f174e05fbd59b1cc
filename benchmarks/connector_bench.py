"""KV-connector protocol costs and gains, measured side by side in one process.

1. Overhead: engine throughput with a connector configured but no hits (every prompt unique)
   vs no connector. Every round runs fresh prompts on every engine, in alternating order;
   each connector's loss is paired with the no-connector run of its round, and the median of
   those paired losses is reported with a bootstrap interval. A no-op connector's row is the
   protocol's own cost; the 'connector time' column (wall time of all connector calls on the
   engine thread) is each connector's cost independent of machine noise, and the page-fault
   column (fresh zeroed pages mapped during a run) shows memory the run did not reuse.
   Target: <= 2% loss.
2. TTFT of a 2k-token prompt on the ~140M model: ExampleConnector hit (a fresh engine, empty
   local prefix cache, on a folder that holds the prompt) vs recompute. Target: hit >= 5x.

    .venv/bin/python benchmarks/connector_bench.py            # full run
    .venv/bin/python benchmarks/connector_bench.py --quick    # smoke run on the tiny model
    .venv/bin/python benchmarks/connector_bench.py --rounds 12 --no-ttft   # overhead only
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.connector_cost import (
    HookTimer,
    paired_summary,
    side_cpu_delta,
    side_thread_cpu,
)
from benchmarks.harness.engines import make_llm
from benchmarks.harness.markdown import markdown_table
from benchmarks.harness.models import get_model, model_vocab_size
from benchmarks.harness.paths import REPO_ROOT
from benchmarks.harness.prompts import make_prompts
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.timing import alternating

EXAMPLES = str(REPO_ROOT)
ENGINE_ARGS = {"max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def _engine(model: Path, dtype: str, kv: dict[str, Any] | None) -> Any:
    return make_llm(model, dtype, kv, **ENGINE_ARGS)


def _run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate ``max_tokens`` for every prompt, and the tokens."""
    from kvferry import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _configs(tmp: Path) -> dict[str, dict[str, Any] | None]:
    return {
        "none": None,
        "NoOpConnector (protocol only)": {
            "kv_connector": "NoOpConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "benchmarks.harness.noop_connector",
        },
        "ExampleConnector (stores every prompt to disk)": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
        },
        "HostPrefixConnector (README example, host memory)": {
            "kv_connector": "HostPrefixConnector",
            "kv_role": "kv_both",
            "kv_connector_module_path": "examples.host_prefix_connector",
            "kv_connector_extra_config": {"max_blocks": 4096},
        },
    }


def _minor_faults() -> int:
    """Page faults the process took without I/O so far: each one maps a fresh zeroed page
    (first touch of new heap or pool memory), which slows whatever op touches it."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def overhead(
    model: Path, dtype: str, num: int, max_tokens: int, rounds: int, only: str = ""
) -> dict[str, Any]:
    """Every round runs the same fresh prompts on every engine, in alternating order; each
    connector's loss is paired with the no-connector run of its own round. ``only``: a
    comma-separated list of name prefixes to keep (the no-connector engine always runs)."""
    sys.path.insert(0, EXAMPLES)
    tmp = Path(tempfile.mkdtemp(prefix="kvferry-bench-"))
    keep = [k.strip() for k in only.split(",") if k.strip()]
    configs = {
        name: kv
        for name, kv in _configs(tmp).items()
        if name == "none" or not keep or any(name.startswith(k) for k in keep)
    }
    engines = {name: _engine(model, dtype, kv) for name, kv in configs.items()}
    vocab = model_vocab_size(model)
    for llm in engines.values():  # warm-up: one untimed round of the real size
        _run(llm, make_prompts(num, vocab, seed=999), max_tokens)
    hooks = {name: HookTimer(llm) for name, llm in engines.items() if name != "none"}
    times: dict[str, list[float]] = {name: [] for name in engines}
    main_cpu: dict[str, list[float]] = {name: [] for name in engines}
    faults: dict[str, list[int]] = {name: [] for name in engines}
    side_cpu = dict.fromkeys(engines, 0.0)
    hook_s = dict.fromkeys(engines, 0.0)
    tokens = 0
    identical = True
    for r in range(rounds):
        prompts = make_prompts(num, vocab, seed=1000 + r)  # fresh ids: no hits anywhere
        ref: list[list[int]] | None = None
        for name in alternating(list(engines), r):
            llm = engines[name]
            llm.engine.scheduler.reset_prefix_cache()
            h0 = hooks[name].total if name in hooks else 0.0
            s0 = side_thread_cpu()
            f0 = _minor_faults()
            c0 = time.thread_time()
            elapsed, out = _run(llm, prompts, max_tokens)
            main_cpu[name].append(time.thread_time() - c0)
            faults[name].append(_minor_faults() - f0)
            side_cpu[name] += side_cpu_delta(s0, side_thread_cpu())
            hook_s[name] += (hooks[name].total if name in hooks else 0.0) - h0
            times[name].append(elapsed)
            tokens = sum(map(len, out))
            identical = identical and (ref is None or out == ref)
            ref = out if ref is None else ref
    shutil.rmtree(tmp, ignore_errors=True)
    base_s = sum(times["none"])
    rows = {}
    for name, ts in times.items():
        rows[name] = {
            "tok_s": tokens / statistics.median(ts),
            "seconds": ts,
            # 1 - (tok/s with the connector) / (tok/s without), per round
            "paired_loss": paired_summary(
                [1 - o / t for t, o in zip(ts, times["none"], strict=True)]
            ),
            "engine_thread_cpu_loss": paired_summary(
                [c / o - 1 for c, o in zip(main_cpu[name], main_cpu["none"], strict=True)]
            ),
            "minor_faults": faults[name],
            "hook_share": hook_s[name] / base_s,
            "side_thread_cpu_share": side_cpu[name] / base_s,
            "hooks": {
                m: {"s": s, "calls": hooks[name].calls[m]}
                for m, s in sorted(hooks[name].seconds.items(), key=lambda kv: -kv[1])
            }
            if name in hooks
            else {},
        }
    return {
        "dtype": dtype,
        "num_prompts": num,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "identical_outputs": identical,
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


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def overhead_report(ov: dict[str, Any], model_name: str) -> str:
    rows = []
    for name, r in ov["rows"].items():
        if name == "none":
            continue
        p, c = r["paired_loss"], r["engine_thread_cpu_loss"]
        rows.append(
            [
                name,
                f"{r['tok_s']:.1f}",
                f"{_pct(p['median'])} [{_pct(p['ci95'][0])}, {_pct(p['ci95'][1])}]",
                _pct(c["median"]),
                f"{statistics.median(r['minor_faults']):,.0f}",
                f"{100 * r['hook_share']:.2f}%",
                f"{100 * r['side_thread_cpu_share']:.2f}%",
            ]
        )
    lines = [
        f"## Connector overhead, no hits ({model_name}, {ov['dtype']}, {ov['num_prompts']} "
        f"prompts x {ov['max_tokens']} tokens, {ov['rounds']} rounds, configs interleaved in "
        f"alternating order; none: {ov['rows']['none']['tok_s']:.1f} output tok/s)\n",
        markdown_table(
            [
                "connector",
                "output tok/s",
                "loss vs none: median of paired rounds [95% bootstrap]",
                "engine-thread CPU vs none",
                "page faults per run (none: "
                f"{statistics.median(ov['rows']['none']['minor_faults']):,.0f})",
                "connector time",
                "connector threads' CPU",
            ],
            rows,
        ),
        "\n'connector time': wall time of every connector call on the engine thread (per-layer "
        "hooks included) as a share of the no-connector run; 'connector threads' CPU': CPU "
        "time of the process's other Python threads, same base. Neither depends on machine "
        f"noise. Outputs identical across configs: {ov['identical_outputs']}.\n",
    ]
    for name, r in ov["rows"].items():
        top = list(r["hooks"].items())[:4]
        if top:
            parts = ", ".join(f"{m} {1000 * h['s']:.0f} ms/{h['calls']}" for m, h in top)
            lines.append(f"- {name}: {parts}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, small sizes")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=None, help="default 10 (--quick: 2)")
    ap.add_argument("--no-ttft", action="store_true", help="overhead only")
    ap.add_argument(
        "--connectors",
        default="",
        help="comma-separated name prefixes to run, e.g. 'NoOp,HostPrefix' (default: all)",
    )
    args = ap.parse_args()
    model = get_model("tiny" if args.quick else "mid")
    num, max_tokens, plen = (8, 16, 512) if args.quick else (32, 64, 2048)
    rounds = args.rounds or (2 if args.quick else 10)
    result: dict[str, Any] = {
        **run_header(),
        "model": model.name,
        "overhead": overhead(model, args.dtype, num, max_tokens, rounds, args.connectors),
    }
    if not args.no_ttft:
        result["ttft"] = ttft(model, args.dtype, plen, 2 if args.quick else 3)
    out = write_json(result_path("connector", args.quick), result)
    print(overhead_report(result["overhead"], model.name))
    if "ttft" in result:
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
        print(f"\nexternal tokens per hit: {t['external_tokens']}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
