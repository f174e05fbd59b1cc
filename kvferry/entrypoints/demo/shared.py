"""``kvferry demo shared``: two instances share prompt KV through a Mooncake Store, behind
the KV-aware proxy, on localhost.

Starts a ``mooncake_master`` (with a storage client that holds the store's memory), two
``kvferry serve`` instances with the MultiConnector chain (engine pool -> host memory ->
the store; see :mod:`.shared_cluster`), a plain instance for reference and ``kvferry proxy
--policy kv_aware --kv-shared-medium cpu``. It then sends a long prompt through the proxy,
asks for it again on both instances after the first one's pool dropped it, stops the
instance that computed a second prompt and sends that prompt through the proxy again. Each
line says which instance served the request, why the proxy chose it, and where its cached
prompt tokens came from (pool, host, store); every answer is compared with the plain
instance's. Everything started is stopped at the end.
"""

from __future__ import annotations

import argparse
import random
import shlex
import tempfile
from pathlib import Path

from kvferry.config import ConfigError
from kvferry.entrypoints.demo.processes import connector_stats, scrape
from kvferry.entrypoints.demo.shared_cluster import STORE_CHILD, SharedCluster

# A small pool (32 blocks of 16 tokens) so a few other prompts push a prompt out of it.
DEFAULT_SERVER_ARGS = "--num-kv-blocks 32 --max-model-len 512 --max-num-batched-tokens 512"
PROMPT_LEN = 150
CHUNKS = (PROMPT_LEN - 1) // 32  # whole chunks of 2 blocks before the prompt's last token


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(5, 2000) for _ in range(PROMPT_LEN)]


def run_shared(args: argparse.Namespace) -> int:
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("the demo needs the openai package: pip install openai") from None
    from kvferry.kv_transfer.stores.mooncake_client import mooncake_available

    why = mooncake_available()
    if why is not None:
        raise ConfigError(f"kvferry demo shared needs Mooncake: {why}")
    model = Path(args.model)
    if not (model / "config.json").is_file():
        from kvferry.model.tiny import make_tiny_model

        print(f"no model at {model}; writing a tiny random llama there")
        make_tiny_model(model, arch="llama")
    log_dir = Path(tempfile.mkdtemp(prefix="kvferry-demo-shared-"))
    server_args = args.server_args if args.server_args is not None else DEFAULT_SERVER_ARGS
    print(f"kvferry demo shared: model {model}, logs in {log_dir}")
    with SharedCluster(model, log_dir, shlex.split(server_args)) as cluster:
        print(f"  mooncake_master {cluster.master.master_address}")
        for inst in cluster.instances():
            print(f"  {inst.name:<9} {inst.url}")
        return _exercise(cluster, args.max_tokens)


def _exercise(c: SharedCluster, max_tokens: int) -> int:
    rng = random.Random(7)
    ok = True

    def ask(label: str, prompt: list[int], to: str | None = None) -> str:
        nonlocal ok
        assert c.reference is not None
        served = c.ask(prompt, max_tokens, to=to)
        same = served.token_ids == c.complete(c.reference.url, prompt, max_tokens)
        ok &= same
        print(f"{label:<34} {served.describe()}; same as plain instance: {'yes' if same else 'NO'}")
        return served.instance

    prompt = _prompt(rng)
    print(f"\nprompt 1 ({PROMPT_LEN} tokens):")
    x = ask("through the proxy", prompt)
    y = next(s.name for s in c.servers if s.name != x)
    c.wait_stored(x, CHUNKS)
    ask("through the proxy, again", prompt)
    ask(f"on {y} (its host tier is empty)", prompt, to=y)
    for _ in range(4):
        c.ask(_prompt(rng), max_tokens, to=x)
    print(f"  (4 other prompts on {x}: prompt 1 left its pool)")
    ask(f"on {x}", prompt, to=x)

    prompt = _prompt(rng)
    print(f"\nprompt 2 ({PROMPT_LEN} tokens):")
    before = {s.name: _store_stat(c, s.name, "stored_chunks") for s in c.live()}
    z = ask("through the proxy", prompt)
    c.wait_stored(z, int(before[z]) + CHUNKS)
    c.stop_instance(z)
    print(f"  ({z} stopped)")
    ask("through the proxy", prompt)
    c.start_instance(z)
    print(f"  ({z} started again: empty pool and host tier)")
    ask(f"on {z}", prompt, to=z)

    print()
    for s in c.live():
        stats = connector_stats(scrape(s.url))
        print(
            f"{s.name}: store puts {stats.get(f'{STORE_CHILD}.put_bytes', 0) / 1e6:.2f} MB, "
            f"gets {stats.get(f'{STORE_CHILD}.get_bytes', 0) / 1e6:.2f} MB, host-tier hit "
            f"tokens {stats.get('0.OffloadingConnector.hit_tokens_host', 0):.0f}"
        )
    bad = c.logs_without_traceback()
    if bad:
        print(f"tracebacks in the logs of: {', '.join(bad)}")
    ok &= not bad
    print("all answers match the plain instance" if ok else "MISMATCH against the plain instance")
    return 0 if ok else 1


def _store_stat(c: SharedCluster, name: str, stat: str) -> float:
    return connector_stats(scrape(c.server(name).url)).get(f"{STORE_CHILD}.{stat}", 0.0)
