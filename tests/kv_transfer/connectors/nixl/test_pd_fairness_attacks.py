"""Fairness attacks at small scale against real instances (issue 11;
``tests/helpers/nixl_harness.py`` processes, UCX over loopback): forged reads and releases
at dead ports, and an outsider renewing holds. Each asserts the legitimate request's
latency against its baseline and that no block leaks."""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq

from kvferry.kv_transfer.connectors.pd import handshake as hs
from tests.helpers.nixl_instance import (
    Instance,
    assert_all_free,
    fake_params,
    nixl_kv,
    submit_decode,
    submit_prefill,
)
from tests.helpers.ports import _dead_port

pytest.importorskip("nixl", reason="the NixlConnector needs the nixl package (extra 'nixl')")


# -- the attacks against real instances ------------------------------------------------------

LEASE_S = 4.0


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fairness-logs")
    model = tiny_model_factory("llama")
    procs = {
        "P": Instance("P", model, nixl_kv("kv_producer"), logs / "P.log"),
        "D": Instance("D", model, nixl_kv("kv_consumer", "fail"), logs / "D.log"),
    }
    try:
        for inst in procs.values():
            inst.ready = inst.wait("ready", 120)  # type: ignore[attr-defined]
        yield procs
    finally:
        for inst in procs.values():
            inst.close()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


def _legit(p: Instance, d: Instance, seeds: list[int], n: int = 64) -> float:
    """Proxied requests decoded at the same time (their prefills done first): the median
    latency of their decodes."""
    prompts = [_prompt(seed, n) for seed in seeds]
    params = [p.wait(submit_prefill(p, prompt))["kv_transfer_params"] for prompt in prompts]

    def decode(prompt: list[int], kv_params: dict[str, Any]) -> float:
        t0 = time.monotonic()
        out = d.wait(submit_decode(d, prompt, kv_params))
        assert out["finish_reason"] == "length" and out["external_cached"] == n, out
        return time.monotonic() - t0

    with ThreadPoolExecutor(len(seeds)) as pool:
        return statistics.median(pool.map(decode, prompts, params))


def _no_leaks(p: Instance, d: Instance) -> None:
    assert_all_free(p, within=LEASE_S * 3)
    assert_all_free(d, within=10)


@pytest.mark.slow
def test_forged_reads_and_releases_at_dead_ports_do_not_delay_the_real_ones(pair):
    p, d = pair["P"], pair["D"]
    base = _legit(p, d, [10, 11, 12])
    real = p.ready["engine_id"]  # type: ignore[attr-defined]
    dead = _dead_port()
    prompt = _prompt(9, 40)
    # The real prefill's engine id at a dead port (it used to fail every read from P for the
    # handshake timeout), 16 forged engine ids, and 24 forged releases.
    forged = [submit_decode(d, prompt, fake_params(prompt, real, dead))]
    forged += [
        submit_decode(d, prompt, fake_params(prompt, f"forged-{i}", dead)) for i in range(16)
    ]
    for i in range(24):
        d.call("release", kv_transfer_params=fake_params(prompt, f"gone-{i}", dead))
    took = _legit(p, d, [13, 14, 15])  # these used to wait behind all the forged work
    assert took < 2 * base + 1.0, (took, base)
    for cid in forged:
        out = d.wait(cid, timeout=10)
        assert out["finish_reason"] == "error", out
    _no_leaks(p, d)


@pytest.mark.slow
def test_an_outsider_cannot_pin_the_prefill_pool(pair):
    """Heartbeats from one outsider keep at most max_reader_share of P's pool (0.5 here)
    held; a legitimate large request still gets its blocks and its decode."""
    p, d = pair["P"], pair["D"]
    total = p.call("status")["num_blocks"]
    held: list[str] = []  # what the outsider renews: it learns each hold as it is made
    stop = threading.Event()
    ctx = zmq.Context()
    codec = hs.Codec(hs.Compat(p.ready["compat"]))  # type: ignore[attr-defined]
    renewed: dict[str, int] = defaultdict(int)

    def outsider() -> None:
        while not stop.wait(0.3):
            beat = hs.HeartbeatRequest(p.ready["engine_id"], list(held), "outsider")  # type: ignore[attr-defined]
            reply = hs.call(ctx, "127.0.0.1", p.ready["port"], codec, beat, 2.0)  # type: ignore[attr-defined]
            if isinstance(reply, hs.Renewed):
                for rid in reply.held:
                    renewed[rid] += 1

    beater = threading.Thread(target=outsider, daemon=True)
    beater.start()
    try:
        # 15 holds of 30 blocks: about 88% of the pool.
        for cid in [submit_prefill(p, _prompt(100 + i, 480)) for i in range(15)]:
            held.append(p.wait(cid)["kv_transfer_params"]["remote_request_id"])
        time.sleep(LEASE_S * 1.5)  # what the outsider could not renew has expired by now
        st = p.call("status")
        assert st["free_blocks"] >= total // 2 - 30, st  # at most half pinned (+ one hold)
        assert 0 < len(renewed) < len(held), renewed  # it did renew, up to its limit
        t0 = time.monotonic()
        _legit(p, d, [20], n=3000)  # 188 blocks: needs what the outsider let go
        assert time.monotonic() - t0 < 30  # it used to wait for kv_lease_max_duration
    finally:
        stop.set()
        beater.join(5)
        ctx.term()
    _no_leaks(p, d)
