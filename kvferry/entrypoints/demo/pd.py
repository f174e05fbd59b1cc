"""``kvferry demo pd``: prefill/decode disaggregation on localhost, end to end.

Starts a prefill and a decode instance (``kvferry serve``) and the proxy as subprocesses on
free loopback ports, sends a few chat requests through the ``openai`` client to the proxy
(streaming, greedy), checks every answer against the same request served by a single instance,
prints TTFT, the decode side's external KV hits, and the connector's transfer bytes and
bandwidth from the instances' ``/metrics``, then shuts everything down.

Connector: ``--kv-transfer-config`` for both instances (or ``--prefill-kv-transfer-config`` /
``--decode-kv-transfer-config``). By default NixlConnector with kv_role ``kv_both`` when it is
available, else ExampleConnector over a shared temporary folder (the decode instance then reads
the prompt's KV from disk instead of over the network).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from kvferry.config import ConfigError
from kvferry.entrypoints.demo.processes import (
    Instance,
    scrape,
    start,
    stop,
    transfer_summary,
    wait_healthy,
    wait_listening,
)

PROMPTS = [
    "Write one sentence about a ferry crossing a river at dawn.",
    "Name three things a cache is good for.",
    "Describe the sound of rain on a tin roof.",
]


def _chat(base_url: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="demo", max_retries=0)
    msgs: Any = [{"role": "user", "content": prompt}]
    extra = {"ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    if not stream:
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0, extra_body=extra
        )
        return {"text": r.choices[0].message.content or "", "total": time.perf_counter() - t0}
    ttft, parts = None, []
    events = client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra,
    )
    for ev in events:
        if ev.choices and ev.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(ev.choices[0].delta.content)
    return {"text": "".join(parts), "ttft": ttft, "total": time.perf_counter() - t0}


def default_kv_config(log_dir: Path) -> dict[str, Any]:
    from kvferry.kv_transfer.factory import KVConnectorFactory

    if "NixlConnector" in KVConnectorFactory.registered_names():
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    folder = str(log_dir / "kv-store")
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": folder},
    }


def _parse_json(text: str | None, flag: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object")
    return value


def run_pd(args: argparse.Namespace) -> int:
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("the demo needs the openai package: pip install openai") from None
    model = Path(args.model)
    if not (model / "config.json").is_file():
        from kvferry.model.tiny import make_tiny_model

        print(f"no model at {model}; writing a tiny random llama there")
        make_tiny_model(model, arch="llama")
    log_dir = Path(tempfile.mkdtemp(prefix="kvferry-demo-"))
    both = _parse_json(args.kv_transfer_config, "--kv-transfer-config")
    base = both or default_kv_config(log_dir)
    p_kv = _parse_json(args.prefill_kv_transfer_config, "--prefill-kv-transfer-config") or base
    d_kv = _parse_json(args.decode_kv_transfer_config, "--decode-kv-transfer-config") or base
    if p_kv is d_kv and "kv_port" not in p_kv:
        # Two instances on one host need two side-channel ports.
        p_kv, d_kv = {**p_kv, "kv_port": 14579}, {**d_kv, "kv_port": 14589}
    server_args = args.server_args
    if server_args is None:
        server_args = "--kv-cache-memory 256MiB"
    extra = shlex.split(server_args)
    common = [str(model), "--port", "0", "--served-model-name", "demo", *extra]
    print(f"kvferry demo pd: model {model}, logs in {log_dir}")
    print(f"  prefill connector: {json.dumps(p_kv)}\n  decode connector:  {json.dumps(d_kv)}")
    instances: list[Instance] = []
    try:
        for name, kvc in (("prefill", p_kv), ("decode", d_kv)):
            argv = ["serve", *common, "--kv-transfer-config", json.dumps(kvc)]
            instances.append(start(name, argv, log_dir))
        p_url, d_url = (wait_listening(i) for i in instances)
        proxy_argv = ["proxy", "--port", "0", "--prefill", p_url, "--decode", d_url]
        instances.append(start("proxy", proxy_argv, log_dir))
        proxy_url = wait_listening(instances[-1])
        for inst in instances[:2]:
            wait_healthy(inst.url, inst=inst)
        wait_healthy(proxy_url, inst=instances[-1])
        for inst in instances:
            print(f"  {inst.name:<8} {inst.url}")
        return exercise(args, p_url, d_url, proxy_url)
    finally:
        stop(instances)


def exercise(
    args: argparse.Namespace, p_url: str, d_url: str, proxy_url: str, model: str = "demo"
) -> int:
    """Send the demo's chat requests through the proxy, compare, print metrics; 0 if all
    answers match the single-instance ones."""
    ok = True
    for i, prompt in enumerate(PROMPTS[: args.num_requests], 1):
        via_pd = _chat(proxy_url, model, prompt, args.max_tokens, stream=True)
        single = _chat(p_url, model, prompt, args.max_tokens, stream=False)
        same = via_pd["text"] == single["text"]
        ok &= same
        ttft = via_pd["ttft"] * 1e3 if via_pd["ttft"] is not None else float("nan")
        print(
            f"request {i}: TTFT {ttft:.1f} ms, total {via_pd['total'] * 1e3:.0f} ms, "
            f"same as single instance: {'yes' if same else 'NO'}\n"
            f"   {prompt!r} -> {via_pd['text'][:60]!r}"
        )
    d = scrape(d_url)
    hits = d.get("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}", 0.0)
    prompt_tokens = d.get("vllm:prompt_tokens_total", 0.0)
    ttft_n = d.get("vllm:time_to_first_token_seconds_count", 0.0)
    ttft_mean = d.get("vllm:time_to_first_token_seconds_sum", 0.0) / max(ttft_n, 1.0)
    print(
        f"decode instance: {hits:.0f} of {prompt_tokens:.0f} prompt tokens came through the "
        f"connector; engine TTFT mean {ttft_mean * 1e3:.1f} ms"
    )
    for name, url in (("prefill", p_url), ("decode", d_url)):
        print(f"{name} instance: {transfer_summary(scrape(url))}")
    print("all answers match the single-instance run" if ok else "MISMATCH against single run")
    return 0 if ok else 1
