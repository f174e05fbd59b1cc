"""Attacks on a prefill/decode pair (NixlConnector, deployment secret configured) by someone who
can reach the instances' HTTP ports and side channels on the same network, but holds no
secret: forged kv_transfer_params, forged releases, forged side-channel messages, outsider
heartbeats; and the CPU an idle pair burns."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil

from kvferry.kv_transfer.connectors.pd import handshake
from tests.helpers.servers import dead_port

from .conftest import LEASE_S, nixl_kv
from .harness import (
    PROFILE,
    Attack,
    Service,
    free_port,
    run_attack,
    serve_service,
    token_ids,
)
from .sidechannel import Outsider, compat_of, leaks_compat

DRAIN_S = LEASE_S + 10.0
IDLE_CPU_TARGET = 0.02  # of one core


_local = threading.local()


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 30.0) -> httpx.Response | str:
    http = getattr(_local, "http", None)
    if http is None:
        http = _local.http = httpx.Client(trust_env=False, timeout=timeout)
    try:
        return http.post(url + path, json=body)
    except httpx.HTTPError as e:
        return type(e).__name__


def _status(r: httpx.Response | str) -> int | str:
    return r.status_code if isinstance(r, httpx.Response) else r


def prefill_hold(prefill: Service, seed: int, n: int = 48) -> tuple[list[int], dict[str, Any]]:
    """As an ordinary client: have the prefill instance compute a prompt and hold its KV; the
    genuine (signed) params it returns."""
    prompt = token_ids(n, seed)
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    r = _post(prefill.url, "/v1/completions", body)
    assert isinstance(r, httpx.Response) and r.status_code == 200, f"prefill: {_status(r)}"
    params = r.json().get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), f"no params from the prefill: {r.text}"
    return prompt, params


def release(url: str, params: dict[str, Any]) -> int | str:
    return _status(_post(url, "/v1/kv/release", {"kv_transfer_params": params}))


def held(svc: Service) -> float:
    state = svc.kv_state()
    return state.held if state is not None else -1


def _tally(a: Attack, label: str, got: Any) -> None:
    counts = a.details.setdefault("answers", {}).setdefault(label, {})
    counts[str(got)] = counts.get(str(got), 0) + 1


def test_forged_kv_transfer_params(pd_up, pd_good) -> None:
    p, d = pd_up["prefill"], pd_up["decode"]

    def forgeries(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
        unsigned = {k: v for k, v in params.items() if k != "kv_signature"}
        blocks = params["remote_block_ids"]
        return {
            "dead port": {**params, "remote_port": dead_port()},
            "other host": {**params, "remote_host": "127.0.0.2"},
            "other blocks": {**params, "remote_block_ids": [b + 1 for b in blocks]},
            "other token count": {**params, "remote_num_tokens": params["remote_num_tokens"] - 1},
            "unsigned": unsigned,
            "unsigned, forged engine id": {
                **unsigned,
                "remote_engine_id": uuid.uuid4().hex,
                "remote_port": dead_port(),
            },
            "signature of other params": {**params, "remote_request_id": uuid.uuid4().hex},
        }

    def attack(a: Attack) -> None:
        for i in a.rounds():
            prompt, params = prefill_hold(p, 1000 + i)
            jobs = list(forgeries(params).items())
            bodies = [
                {"model": "tiny", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": f}
                for _, f in jobs
            ]
            with ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(
                    pool.map(lambda b: _status(_post(d.url, "/v1/completions", b)), bodies)
                )
            for (label, _), got in zip(jobs, answers, strict=True):
                _tally(a, label, got)
                a.check(got == 400, f"forged params ({label}): decode answered {got}, expected 400")
            a.check(
                release(p.url, params) == 200, "the genuine release of the attacker's hold failed"
            )

    r = run_attack(
        "forged_kv_params",
        "Forged kv_transfer_params to the decode instance (tampered host/port/blocks, "
        "unsigned, real engine id with a dead port)",
        attack,
        good=pd_good,
        watch=[p, d],
        drain_s=DRAIN_S,
    )
    assert not r.violations, r.summary()


def test_forged_release(pd_up, pd_good) -> None:
    p, d = pd_up["prefill"], pd_up["decode"]

    def attack(a: Attack) -> None:
        _, victim = prefill_hold(p, 2000)  # a hold the forged releases must not end
        taken = time.monotonic()
        for _ in a.rounds():
            if time.monotonic() - taken > LEASE_S / 2:  # its lease would end it anyway
                _, victim = prefill_hold(p, 2000)
                taken = time.monotonic()
            unsigned = {k: v for k, v in victim.items() if k != "kv_signature"}
            forged = [
                {**unsigned, "remote_engine_id": uuid.uuid4().hex, "remote_port": dead_port()}
                for _ in range(8)
            ]
            forged += [{**unsigned, "remote_port": dead_port()} for _ in range(8)]
            forged += [unsigned, {**victim, "remote_request_id": uuid.uuid4().hex}]
            jobs = [(url, f) for url in (p.url, d.url) for f in forged]
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda j: release(j[0], j[1]), jobs))
            for got in answers:
                _tally(a, "forged release", got)
                a.check(
                    isinstance(got, int) and 400 <= got < 500,
                    f"a forged /v1/kv/release was answered {got}, expected a 4xx refusal",
                )
        a.details["victim_held_after"] = held(p)
        a.check(held(p) >= 1, "forged releases ended another client's hold")
        _, victim = prefill_hold(p, 2000)  # fresh, so no lease ends it during the check
        before = held(p)
        t0 = time.monotonic()
        a.check(release(p.url, victim) == 200, "the genuine release failed")
        # Good requests make and end holds meanwhile: look for the drop, do not re-read after.
        freed = False
        while not freed and time.monotonic() - t0 < 1.0:
            freed = held(p) <= before - 1
            if not freed:
                time.sleep(0.02)
        a.details["genuine_release_freed_after_s"] = round(time.monotonic() - t0, 3)
        a.check(freed, "a genuine release's 200 came before its blocks were back")

    r = run_attack(
        "forged_release",
        "Forged POST /v1/kv/release (unsigned, forged engine ids, dead ports)",
        attack,
        good=pd_good,
        watch=[p, d],
        drain_s=DRAIN_S,
    )
    assert not r.violations, r.summary()


def _requests(params: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    from kvferry.kv_transfer.connectors.pd.params import token_digest

    engine, rid = params["remote_engine_id"], params["remote_request_id"]
    blocks = params["remote_block_ids"]
    return {
        "handshake": handshake.HandshakeRequest(engine_id=engine, rank=0),
        "claim": handshake.ClaimRequest(
            engine_id=engine,
            request_id=rid,
            block_ids=blocks,
            num_tokens=params["remote_num_tokens"],
            token_digest=token_digest(prompt, params["remote_num_tokens"]),
            reader_engine_id="outsider",
            reader_agent="outsider-agent",
        ),
        "release": handshake.ReleaseRequest(
            engine_id=engine, request_id=rid, block_ids=blocks, reader_engine_id="outsider"
        ),
        "heartbeat": handshake.HeartbeatRequest(
            engine_id=engine, request_ids=[rid], reader_engine_id="outsider"
        ),
    }


ACCEPTED = {"agent", "granted", "ack", "renewed"}


def _accepted(kind: str, reply: dict[str, Any]) -> bool:
    """Whether the instance did what an outsider asked."""
    t = reply.get("type")
    if t == "ack":
        return bool(reply.get("count"))
    if t == "renewed":
        return bool(reply.get("held"))
    return t in ACCEPTED


def test_forged_side_channel(pd_up, pd_good, chaos_model) -> None:
    p, d = pd_up["prefill"], pd_up["decode"]
    outsider = Outsider(compat_of(chaos_model))

    def attack(a: Attack) -> None:
        prompt, params = prefill_hold(p, 3000)
        host, port = params["remote_host"], params["remote_port"]
        for _ in a.rounds():
            for kind, msg in _requests(params, prompt).items():
                for variant, frame in outsider.frames(msg).items():
                    reply = outsider.ask(host, port, frame)
                    label = f"{kind} ({variant})"
                    _tally(a, label, reply.get("type"))
                    a.check(
                        not _accepted(kind, reply),
                        f"outsider {label}: answered {reply.get('type')!r}",
                    )
                    a.check(
                        not leaks_compat(reply),
                        f"outsider {label}: refusal names the compatibility description",
                    )
        a.check(held(p) >= 1, "an outsider's side-channel release ended a hold")
        a.check(release(p.url, params) == 200, "the genuine release failed")

    try:
        r = run_attack(
            "forged_side_channel",
            "Forged side-channel envelopes (handshake, claim, release, heartbeat without the "
            "secret)",
            attack,
            good=pd_good,
            watch=[p, d],
            drain_s=DRAIN_S,
        )
    finally:
        outsider.close()
    assert not r.violations, r.summary()


def test_outsider_heartbeats(pd_up, pd_good, chaos_model) -> None:
    """Holds an outsider keeps renewing must still end when their lease runs out."""
    p, d = pd_up["prefill"], pd_up["decode"]
    outsider = Outsider(compat_of(chaos_model))

    def attack(a: Attack) -> None:
        with ThreadPoolExecutor(6) as pool:
            holds = list(pool.map(lambda i: prefill_hold(p, 4000 + i, n=160), range(6)))
        held0 = held(p)
        a.details["holds"] = len(holds)
        a.details["held_at_start"] = held0
        host, port = holds[0][1]["remote_host"], holds[0][1]["remote_port"]
        ids = [params["remote_request_id"] for _, params in holds]
        engine = holds[0][1]["remote_engine_id"]
        msg = handshake.HeartbeatRequest(
            engine_id=engine, request_ids=ids, reader_engine_id="outsider"
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < LEASE_S + 2.5:
            for variant, frame in outsider.frames(msg).items():
                reply = outsider.ask(host, port, frame)
                _tally(a, f"heartbeat ({variant})", reply.get("type"))
                a.check(
                    not _accepted("heartbeat", reply),
                    f"outsider heartbeat ({variant}) renewed holds",
                )
            time.sleep(0.5)
        # The good client, one request at a time, may hold one more at any moment.
        left = held(p)
        a.details["held_after_lease"] = left
        a.check(
            left <= 1,
            f"{left:.0f} holds outlived their {LEASE_S:.0f}s lease under outsider heartbeats",
        )

    try:
        r = run_attack(
            "outsider_heartbeats",
            "Heartbeats from an outsider for held requests",
            attack,
            good=pd_good,
            watch=[p, d],
            drain_s=DRAIN_S,
        )
    finally:
        outsider.close()
    assert not r.violations, r.summary()


def test_prefill_with_other_weights(pd_up, pd_good, chaos_model, tmp_path) -> None:
    """A prefill instance that holds the secret but runs other weights from a folder of the
    same name and shapes (a botched deployment): the decode instance must not take its KV,
    and above all must not cache it for later users of that prompt."""
    from kvferry.model.tiny import make_tiny_model

    p, d = pd_up["prefill"], pd_up["decode"]
    other = make_tiny_model(tmp_path / "other" / chaos_model.name, arch="llama", seed=1)
    env = {k: v for k, v in p.env.items() if k in ("UCX_NET_DEVICES", "KVFERRY_KV_SECRET_FILE")}
    rogue = serve_service(
        "rogue", other, tmp_path, kv=nixl_kv(free_port()), num_blocks=128, env=env
    )
    prompt, want = pd_good.prompts[0], pd_good.reference[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": pd_good.max_tokens}
    body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

    def answer(r: httpx.Response | str) -> str:
        if not isinstance(r, httpx.Response):
            return r
        if r.status_code != 200:
            return str(r.status_code)
        return "right" if r.json()["choices"][0]["token_ids"] == want else "WRONG"

    def attack(a: Attack) -> None:
        run = uuid.uuid4().hex[:8]  # fresh salts each time, so no earlier KV answers
        for i in a.rounds():
            r = _post(
                rogue.url,
                "/v1/completions",
                {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
            assert isinstance(r, httpx.Response) and r.status_code == 200, _status(r)
            params = r.json()["kv_transfer_params"]
            got = answer(
                _post(
                    d.url,
                    "/v1/completions",
                    {**body, "cache_salt": f"rogue-{run}-{i}", "kv_transfer_params": params},
                )
            )
            _tally(a, "decode with the other instance's params", got)
            a.check(got != "WRONG", "the decode instance answered with the other weights' KV")
            # The same prompt and salt again, without params: from the decode's prefix cache.
            got = answer(
                _post(d.url, "/v1/completions", {**body, "cache_salt": f"rogue-{run}-{i}"})
            )
            _tally(a, "later request for that prompt", got)
            a.check(
                got == "right", f"a later request for that prompt got {got}: the cache was poisoned"
            )
            release(rogue.url, params)

    try:
        rogue.start()
        rogue.wait_ready()
        r = run_attack(
            "other_weights",
            "Prefill instance with other weights under the same folder name and shapes "
            "(holding the secret)",
            attack,
            good=pd_good,
            watch=[p, d],
            drain_s=DRAIN_S,
        )
    finally:
        rogue.stop()
    assert not r.violations, r.summary()


def _cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    t0 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    w0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - w0
    return {n: (sum(p.cpu_times()[:2]) - t0[n]) / wall for n, p in procs.items()}


def test_idle_cpu(pd_up, single, pd_good) -> None:
    """A P/D pair that has served requests, then sits idle, must not spin a core."""
    p, d = pd_up["prefill"], pd_up["decode"]

    def attack(a: Attack) -> None:
        time.sleep(0.5)  # let the last request's work settle
        cpu = _cpu(
            {"prefill": p.pid, "decode": d.pid, "no connector": single.pid}, a.profile.idle_cpu_s
        )
        a.details["seconds"] = a.profile.idle_cpu_s
        a.details["cpu_of_one_core"] = {k: round(v, 4) for k, v in cpu.items()}
        for name in ("prefill", "decode"):
            a.check(
                cpu[name] <= IDLE_CPU_TARGET,
                f"idle {name} used {cpu[name]:.1%} of a core (target <= {IDLE_CPU_TARGET:.0%})",
            )

    r = run_attack(
        "idle_cpu",
        f"Idle NixlConnector instances (CPU over {PROFILE.idle_cpu_s:.0f} s)",
        attack,
        good=None,
        watch=[p, d],
        drain_s=DRAIN_S,
    )
    assert not r.violations, r.summary()
