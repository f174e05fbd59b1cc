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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.config import ConfigError

PROMPTS = [
    "Write one sentence about a ferry crossing a river at dawn.",
    "Name three things a cache is good for.",
    "Describe the sound of rain on a tin roof.",
]


@dataclass
class Instance:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Instance:
    """Start ``python -m kvferry ARGV`` with output in ``log_dir/NAME.log``."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Instance(name, proc, log)


def wait_listening(inst: Instance, timeout: float = 180.0) -> str:
    """The URL the instance prints once it listens; ConfigError if it dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = inst.log.read_text(errors="replace") if inst.log.exists() else ""
        for line in text.splitlines():
            if " listening on " in line:
                inst.url = line.rsplit(" ", 1)[-1].strip()
                return inst.url
        if inst.proc.poll() is not None:
            tail = "\n".join(text.splitlines()[-15:])
            raise ConfigError(f"{inst.name} exited with code {inst.proc.returncode}:\n{tail}")
        time.sleep(0.05)
    raise ConfigError(f"{inst.name} did not start within {timeout:.0f}s (log: {inst.log})")


def wait_healthy(url: str, timeout: float = 120.0, inst: Instance | None = None) -> None:
    """Wait for ``url/health`` to answer 200; ConfigError on timeout or if ``inst`` dies."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if inst is not None and inst.proc.poll() is not None:
            tail = "\n".join(inst.log.read_text(errors="replace").splitlines()[-15:])
            raise ConfigError(f"{inst.name} exited with code {inst.proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ConfigError(f"{url}/health did not turn healthy within {timeout:.0f}s")


def stop(instances: list[Instance], timeout: float = 15.0) -> None:
    for inst in instances:
        if inst.proc.poll() is None:
            inst.proc.terminate()
    deadline = time.monotonic() + timeout
    for inst in instances:
        try:
            inst.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            inst.proc.kill()
            inst.proc.wait()


_IMPLIED = ("model_name", "engine")


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (labels sorted, without the
    ``model_name`` and ``engine`` every server series carries)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _IMPLIED)
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def connector_stats(metrics: dict[str, float]) -> dict[str, float]:
    """The connector's stats from scraped metrics: counters, and sums of sample lists."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        for prefix in ("kvferry_kv_connector_total{", "kvferry_kv_connector_samples_sum{"):
            if key.startswith(prefix):
                stat = key[len(prefix) : -1].removeprefix("stat=")
                out[stat] = out.get(stat, 0.0) + value
    return out


def transfer_summary(metrics: dict[str, float]) -> str:
    """Bytes and bandwidth the connector reported, or an estimate from external hits."""
    stats = connector_stats(metrics)
    nbytes = sum(v for k, v in stats.items() if "bytes" in k)
    secs = sum(v for k, v in stats.items() if any(w in k for w in ("duration", "seconds")))
    if nbytes > 0:
        bw = f" in {secs * 1e3:.1f} ms = {nbytes / secs / 1e6:.1f} MB/s" if secs > 0 else ""
        return f"connector moved {nbytes / 1e6:.3f} MB{bw}"
    hits = metrics.get("vllm:external_prefix_cache_hits_total", 0.0)
    per_tok = metrics.get("kvferry_kv_cache_bytes_per_token", 0.0)
    detail = f" ({', '.join(f'{k}={v:g}' for k, v in sorted(stats.items()))})" if stats else ""
    return (
        f"no byte counts reported{detail}; {hits:.0f} external hit tokens "
        f"= ~{hits * per_tok / 1e6:.3f} MB of KV"
    )


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
    extra = shlex.split(args.server_args or "")
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


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=["pd"], help="pd: prefill/decode disaggregation")
    p.add_argument("--model", default="models/tiny-llama", help="model folder (made if missing)")
    p.add_argument("--kv-transfer-config", default=None, help="connector JSON for both instances")
    p.add_argument("--prefill-kv-transfer-config", default=None)
    p.add_argument("--decode-kv-transfer-config", default=None)
    p.add_argument("--num-requests", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--server-args",
        default="--kv-cache-memory 256MiB",
        help="extra flags for both servers (default: '--kv-cache-memory 256MiB')",
    )
    p.set_defaults(func=run_pd)
