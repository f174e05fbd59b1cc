"""Multi-turn chat where the engine's KV pool holds only a fraction of the conversations.

``--convs`` conversations of ``--turns`` turns each: a system prompt, then per turn a user
message and the model's answer, every turn sent with the whole history. All conversations'
turn *t* are submitted together. The KV pool holds about ``--pool-fraction`` of the final
conversations, so without offloading most histories are recomputed every turn; with it they
come back from host memory (or from disk, with ``--disk``). Reported: total time, mean and
p90 TTFT, and how many prompt tokens were loaded instead of computed.

    .venv/bin/python benchmarks/offload_multiturn.py          # 20 x 5 on mid bf16, docs
    .venv/bin/python benchmarks/offload_multiturn.py --quick  # smoke run
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.cli import fill_quick_defaults
from benchmarks.harness.engines import drain, make_llm
from benchmarks.harness.kv_configs import offload_kv
from benchmarks.harness.markdown import markdown_table, update_doc
from benchmarks.harness.models import bench_model, model_vocab_size
from benchmarks.harness.paths import IMG_DIR, OFFLOAD_SCRATCH
from benchmarks.harness.plots import bar_plot
from benchmarks.harness.prompts import random_tokens
from benchmarks.harness.results import result_path, write_results_json
from kvferry import SamplingParams


def conversation_run(llm: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(7)
    history = [random_tokens(rng, args.system_len, vocab) for _ in range(args.convs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    ttfts: list[float] = []
    outputs: list[list[int]] = []
    computed = loaded = 0
    t0 = time.perf_counter()
    for _ in range(args.turns):
        prompts = [h + random_tokens(rng, args.user_len, vocab) for h in history]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            m = out.metrics
            ttfts.append(m.ttft)
            loaded += m.num_external_cached_tokens
            computed += len(prompt) - m.num_local_cached_tokens - m.num_external_cached_tokens
            outputs.append(list(out.outputs[0].token_ids))
        history = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
    total = time.perf_counter() - t0
    drain(llm)
    ttfts.sort()
    return {
        "total_s": total,
        "mean_ttft_s": statistics.mean(ttfts),
        "p90_ttft_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "prompt_tokens_computed": computed,
        "prompt_tokens_loaded": loaded,
        "outputs": outputs,
        "connector": llm.engine.kv_connector_totals.as_dict(),
        "preemptions": llm.engine.scheduler.num_preemptions,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    final_len = args.system_len + args.turns * (args.user_len + args.answer_len)
    model = bench_model(args.model, final_len + 64)
    vocab = model_vocab_size(model)
    folder = OFFLOAD_SCRATCH / "multiturn-disk"
    shutil.rmtree(folder, ignore_errors=True)
    pool_blocks = max(int(args.convs * final_len * args.pool_fraction) // 16, final_len // 16 + 8)
    engine_args = {"max_model_len": final_len + 64, "num_kv_blocks": pool_blocks}
    configs = {
        "off": offload_kv("off"),
        "SimpleCPU": offload_kv("simple"),
        "Offloading": offload_kv("offload", blocks_per_chunk=4, offload_prompt_only=False),
    }
    if args.disk:
        small = {"cpu_bytes_to_use": args.small_host_mib << 20}
        configs["Offloading, small host + disk"] = offload_kv(
            "disk", folder, blocks_per_chunk=4, offload_prompt_only=False, **small
        )
    results = {}
    for name, kv in configs.items():
        llm = make_llm(model, args.dtype, kv, **engine_args)
        llm.generate([{"prompt_token_ids": [5] * 32}], SamplingParams(max_tokens=1), use_tqdm=False)
        results[name] = conversation_run(llm, args, vocab)
        llm.engine.shutdown()
        r = results[name]
        print(
            f"{name:>30}: total {r['total_s']:.2f} s, mean TTFT {r['mean_ttft_s'] * 1e3:.0f} ms, "
            f"loaded {r['prompt_tokens_loaded']} / computed {r['prompt_tokens_computed']} tokens"
        )
    shutil.rmtree(folder, ignore_errors=True)
    same = all(r["outputs"] == results["off"]["outputs"] for r in results.values())
    for r in results.values():
        del r["outputs"]
    return {
        "model": args.model,
        "dtype": args.dtype,
        "convs": args.convs,
        "turns": args.turns,
        "final_len": final_len,
        "pool_blocks": pool_blocks,
        "identical_outputs": same,
        "results": results,
    }


def report(res: dict[str, Any], write_docs: bool, quick: bool) -> str:
    base = res["results"]["off"]
    rows = [
        [
            name,
            r["total_s"],
            base["total_s"] / r["total_s"],
            r["mean_ttft_s"] * 1e3,
            r["p90_ttft_s"] * 1e3,
            r["prompt_tokens_computed"],
            r["prompt_tokens_loaded"],
        ]
        for name, r in res["results"].items()
    ]
    headers = ["config", "total s", "speedup", "mean TTFT ms", "p90 TTFT ms"]
    table = markdown_table(headers + ["prompt tokens computed", "loaded"], rows)
    print(table)
    print("outputs identical:", res["identical_outputs"])
    if write_docs:
        suffix = "_quick" if quick else ""
        names = list(res["results"])
        plot = bar_plot(
            IMG_DIR / f"offload_multiturn{suffix}.png",
            names,
            {
                "total s": [res["results"][n]["total_s"] for n in names],
                "mean TTFT s": [res["results"][n]["mean_ttft_s"] for n in names],
            },
            f"{res['convs']} conversations x {res['turns']} turns ({res['model']}, {res['dtype']})",
            "seconds",
        )
        update_doc(
            f"offload_multiturn{suffix}",
            f"### Multi-turn chat{' (smoke run)' if quick else ''}\n\n"
            f"`benchmarks/offload_multiturn.py{' --quick' if quick else ''}`: "
            f"{res['convs']} conversations x {res['turns']} turns, up to {res['final_len']} "
            f"tokens each; the KV pool has {res['pool_blocks']} blocks of 16 tokens. Outputs "
            f"identical across configs: {res['identical_outputs']}.\n\n{table}\n\n"
            f"![multi-turn](img/{plot.name})\n",
        )
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--convs", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--user-len", type=int, default=None)
    ap.add_argument("--answer-len", type=int, default=None)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--disk", action="store_true", help="add a small-host + disk config")
    ap.add_argument("--small-host-mib", type=int, default=16)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()
    quick = args.quick
    fill_quick_defaults(
        args,
        model=("tiny", "mid"),
        convs=(4, 20),
        turns=(3, 5),
        system_len=(64, 512),
        user_len=(16, 64),
        answer_len=(8, 32),
    )
    if quick:
        args.small_host_mib = 1
    res = run(args)
    write_results_json(result_path("offload_multiturn", quick), res)
    report(res, not args.no_docs, quick)


if __name__ == "__main__":
    main()
