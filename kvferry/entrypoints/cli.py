"""The ``kvferry`` command line: generate, serve, proxy, demo, make-tiny-model, trace and
conformance.

Bad input (flags, model folders, prompts) ends with one ``error: ...`` line and exit code 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.config import ConfigError

if TYPE_CHECKING:
    from kvferry.outputs import RequestOutput


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from kvferry.engine.arg_utils import EngineArgs

    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (default 1.0, as in vLLM); 0 is greedy",
    )
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_cmd_generate)


def _cached_tokens(out: RequestOutput) -> dict[str, int]:
    m = out.metrics
    return {
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_local_cached_tokens": m.num_local_cached_tokens if m else 0,
        "num_external_cached_tokens": m.num_external_cached_tokens if m else 0,
    }


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvferry.engine.arg_utils import EngineArgs
    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ConfigError(f"prompts file {args.prompts_file!r} does not exist")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompts given; use --prompt TEXT or --prompts-file FILE")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - t0
    totals = dict.fromkeys(("num_prompt_tokens", "num_local_cached_tokens",
                            "num_external_cached_tokens", "num_output_tokens"), 0)  # fmt: skip
    for out in outputs:
        c = out.outputs[0]
        cached = _cached_tokens(out)
        for key, value in cached.items():
            totals[key] += value
        totals["num_output_tokens"] += len(c.token_ids)
        if args.json:
            record = {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                      "finish_reason": c.finish_reason, **cached}  # fmt: skip
            print(json.dumps(record))
        else:
            print(
                f"--- prompt: {out.prompt!r}\n    output: {c.text!r}  [{c.finish_reason}]\n"
                f"    cached: {cached['num_local_cached_tokens']} local, "
                f"{cached['num_external_cached_tokens']} external "
                f"of {cached['num_prompt_tokens']} prompt tokens"
            )
    n_out = totals["num_output_tokens"]
    if not args.json:
        print(
            f"{len(outputs)} requests, {n_out} output tokens in {elapsed:.2f}s "
            f"({n_out / max(elapsed, 1e-9):.1f} tok/s); engine start-up "
            f"{llm.engine.startup_seconds:.2f}s"
        )
    if args.log_stats:
        # The engine logs at intervals, so a short run would otherwise log nothing.
        from kvferry.logger import fmt_fields, init_logger

        fields: dict[str, int | float] = {"requests": len(outputs), **totals}
        fields["gen_tok_per_s"] = n_out / max(elapsed, 1e-9)
        connector = llm.engine.kv_connector_totals
        if not connector.is_empty():
            fields.update({f"kv_{k}": v for k, v in connector.as_dict().items()})
        init_logger(__name__).info(fmt_fields("engine stats (run total)", **fields))
    return 0


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random-weight Hugging Face checkpoint")
    p.add_argument("out", help="output folder")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default="llama")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="qwen2/qwen3: every other layer (from layer 1) attends to this many tokens only",
    )
    p.set_defaults(func=_cmd_make_tiny_model)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from kvferry.model.tiny import make_tiny_model

    for name in ("hidden", "layers", "heads", "kv_heads", "vocab"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    out = make_tiny_model(
        args.out,
        arch=args.arch,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        max_position_embeddings=args.max_position_embeddings,
        head_dim=args.head_dim,
        dtype=args.dtype,
        seed=args.seed,
        tie_word_embeddings=args.tie_word_embeddings,
        sliding_window=args.sliding_window,
    )
    print(f"wrote {args.arch} model to {out}")
    return 0


def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="render a KV-connector trace (KVFERRY_TRACE_CONNECTOR=1) as mermaid"
    )
    p.add_argument("file", help="trace file (JSON lines)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument(
        "--run",
        type=int,
        default=None,
        help="render only this run (1 is the first, -1 the last); default: one diagram per run",
    )
    p.add_argument("-o", "--output", help="write the diagram here instead of stdout")
    p.set_defaults(func=_cmd_trace)


def _cmd_trace(args: argparse.Namespace) -> int:
    from kvferry.kv_transfer.trace import render_mermaid

    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"trace file {args.file!r} does not exist")
    try:
        text = render_mermaid(path, args.max_steps, args.run)
    except IndexError as e:
        raise ConfigError(f"{args.file}: {e}") from None
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{args.file} is not a kvferry connector trace: {e}") from None
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


def _add_http_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=default_port, help="TCP port (0: any free port)")
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (info shows one access line per request)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from kvferry.engine.arg_utils import EngineArgs
    from kvferry.entrypoints.openai.limits import ServerLimits

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(p, positional_model=True)
    _add_http_args(p, 8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (prefer --api-key-file or "
        "KVFERRY_API_KEY: a command line is visible to every local user)",
    )
    p.add_argument("--api-key-file", default=None, help="file holding the API key")
    p.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: MODEL)"
    )
    p.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="new tokens per streamed chunk; the first and the final chunk are sent at once "
        "(default: 1, a chunk per token)",
    )
    ServerLimits.add_cli_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvferry.entrypoints.openai.api_server import run_server

    return run_server(args)


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proxy", help="router over instances: plain (--instance) or prefill/decode disaggregation"
    )
    p.add_argument(
        "--instance", nargs="+", help="plain instance URL(s), each serving requests whole"
    )
    p.add_argument("--prefill", nargs="+", help="prefill instance URL(s) (P/D)")
    p.add_argument("--decode", nargs="+", help="decode instance URL(s) (P/D)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call")
    _add_routing_args(p)
    p.add_argument(
        "--upstream-api-key-file",
        default=None,
        help="file holding the instances' API key, sent on every upstream call (never the key "
        "itself on the command line)",
    )
    _add_http_args(p, 8100)
    p.set_defaults(func=_cmd_proxy)


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing (the instance, or the prefill instance in P/D)")
    g.add_argument(
        "--policy",
        choices=["round_robin", "least_loaded", "kv_aware"],
        default="round_robin",
        help="round_robin; least_loaded (in flight + the instances' queue depth); kv_aware "
        "(the instance caching the longest prefix, balanced against load)",
    )
    g.add_argument("--tokenizer", help="kv_aware: the model folder the instances serve")
    g.add_argument(
        "--kv-events-endpoint",
        nargs="+",
        metavar="ENDPOINT",
        help="kv_aware: each instance's KV event endpoint (its kv_events_config endpoint, "
        "e.g. tcp://10.0.0.5:5557), in the order of the instances",
    )
    g.add_argument(
        "--kv-replay-endpoint",
        nargs="+",
        metavar="ENDPOINT",
        help="kv_aware: each instance's replay endpoint, same order (for gaps and restarts)",
    )
    g.add_argument("--kv-events-topic", default="", help="the instances' kv_events_config topic")
    g.add_argument(
        "--kv-hit-weight",
        type=float,
        default=4.0,
        help="kv_aware: queued requests a whole-prompt cache hit is worth (default: 4)",
    )
    g.add_argument(
        "--kv-shared-medium",
        nargs="+",
        metavar="MEDIUM",
        default=[],
        help="kv_aware: KV event media of a store every instance reads (e.g. the medium "
        "of MooncakeStoreConnector's events: cpu, lowercase; exact strings): a block announced "
        "there by any instance "
        "counts for all of them",
    )
    g.add_argument(
        "--kv-index-max-blocks",
        type=_positive_int,
        default=200_000,
        help="kv_aware: blocks kept in the prefix index per instance (default: 200000)",
    )
    g.add_argument(
        "--kv-block-size",
        type=_positive_int,
        default=16,
        help="kv_aware: block size until an instance's events tell it (default: 16)",
    )
    g.add_argument(
        "--prefix-caching-hash-algo",
        choices=["kvferry", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"],
        default=None,
        help="kv_aware: the instances' hash algorithm, if known: hashes are recomputed too "
        "(finds blocks announced without token ids, and salted prompts)",
    )
    g.add_argument(
        "--kv-recent-ttl",
        type=float,
        default=10.0,
        help="kv_aware: seconds a prompt just sent to an instance counts as cached there, "
        "until its events arrive (0: off; default: 10)",
    )
    g.add_argument(
        "--load-poll-interval",
        type=float,
        default=1.0,
        help="seconds between /health and /metrics polls of each instance (default: 1)",
    )


def _cmd_proxy(args: argparse.Namespace) -> int:
    from kvferry.entrypoints.proxy import run_proxy

    return run_proxy(args)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from kvferry.entrypoints.demo import add_demo_args

    p = sub.add_parser(
        "demo",
        help="demos; 'pd': prefill/decode disaggregation, 'shared': instances sharing KV through a Mooncake Store",
    )
    add_demo_args(p)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvferry")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from kvferry import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvferry {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_proxy(sub)
    _add_demo(sub)
    _add_make_tiny_model(sub)
    _add_trace(sub)
    from kvferry.entrypoints.conformance import add_conformance_args

    add_conformance_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
