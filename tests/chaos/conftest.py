"""The services the attacks run against, started once for the package (and stopped when its
last test is done, so the rest of the test suite does not share the machine with them):

* ``single``: one ``kvferry serve`` without a connector (intake and HTTP attacks);
* ``pd``: a prefill and a decode instance with NixlConnector (real NIXL/UCX on loopback) and a
  deployment secret, behind ``kvferry proxy``;
* ``disk``: an instance whose OffloadingConnector spills to a disk folder, with the secret;
* ``faulty``: an instance whose connector is FaultInjectionConnector around the host tier,
  failing and corrupting loads, with ``kv_load_failure_policy = recompute``.

Each has a good client (:class:`harness.GoodClient`) warmed up once: its first answers are the
reference every later answer is compared with.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    PROFILE,
    GoodClient,
    Service,
    proxy_service,
    serve_service,
    start_all,
    token_ids,
)

LEASE_S = 5.0
# Short header and body timeouts, so slow clients are seen cut off within the short profile.
HEADER_TIMEOUT = "3" if PROFILE.name == "short" else "10"


def _secret_env(tmp: Path) -> dict[str, str]:
    path = tmp / "kv-secret"
    path.write_text(secrets.token_urlsafe(32))
    path.chmod(0o600)
    return {"KVFERRY_KV_SECRET_FILE": str(path)}


@contextlib.contextmanager
def _running(*services: Service) -> Iterator[None]:
    """Start ``services`` together; stop them in reverse order, whatever happens."""
    try:
        start_all(*services)
        yield
    finally:
        for s in reversed(services):
            s.stop()


@contextlib.contextmanager
def _good_client(*args: Any, **kwargs: Any) -> Iterator[GoodClient]:
    good = GoodClient(*args, **kwargs)
    try:
        good.warm_up()
        yield good
    finally:
        good.close()


@pytest.fixture(scope="package")
def chaos_model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="package")
def single(chaos_model, tmp_path_factory) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("chaos-single")
    timeouts = ["--header-timeout", HEADER_TIMEOUT, "--body-read-timeout", HEADER_TIMEOUT]
    svc = serve_service("single", chaos_model, logs, *timeouts)
    with _running(svc):
        yield svc


@pytest.fixture()
def single_up(single) -> Service:
    single.ensure_up()
    return single


@pytest.fixture(scope="package")
def single_good(single) -> Iterator[GoodClient]:
    with _good_client(
        lambda: single.url, [token_ids(48, 1), token_ids(40, 2)], name="single"
    ) as good:
        yield good


def nixl_kv(kv_port: int) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_port": kv_port,
        "kv_connector_extra_config": {"side_channel_port": 0, "kv_lease_duration": LEASE_S},
    }


@pytest.fixture(scope="package")
def pd(chaos_model, tmp_path_factory) -> Iterator[dict[str, Service]]:
    """``{"prefill", "decode", "proxy"}``; a test that kills one restarts it (same port)."""
    from .harness import free_port

    logs = tmp_path_factory.mktemp("chaos-pd")
    env = {"UCX_NET_DEVICES": "lo", **_secret_env(logs)}
    p = serve_service(
        "prefill", chaos_model, logs, kv=nixl_kv(free_port()), num_blocks=128, env=env
    )
    d = serve_service("decode", chaos_model, logs, kv=nixl_kv(free_port()), num_blocks=128, env=env)
    proxy = proxy_service("proxy", logs, p, d)
    with _running(p, d, proxy):
        yield {"prefill": p, "decode": d, "proxy": proxy}


@pytest.fixture()
def pd_up(pd) -> dict[str, Service]:
    """The P/D trio, with anything a previous test left dead started again."""
    for name in ("prefill", "decode", "proxy"):
        pd[name].ensure_up()
    return pd


@pytest.fixture(scope="package")
def pd_good(pd) -> Iterator[GoodClient]:
    # Prompts of several blocks, so every request moves KV from prefill to decode.
    with _good_client(
        lambda: pd["proxy"].url, [token_ids(48, 3), token_ids(64, 4)], name="pd"
    ) as good:
        yield good


DISK_PROMPTS = 6  # each 10 blocks: together more than the pool and the host tier hold


@pytest.fixture(scope="package")
def disk(chaos_model, tmp_path_factory) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("chaos-disk")
    folder = logs / "kv-disk"
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        # A chunk refused at load time is computed again instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "num_cpu_chunks": 4,
            "disk_path": str(folder),
            "offload_prompt_only": False,
        },
    }
    svc = serve_service("disk", chaos_model, logs, kv=kv, num_blocks=40, env=_secret_env(logs))
    svc.env["CHAOS_DISK_FOLDER"] = str(folder)
    with _running(svc):
        yield svc


@pytest.fixture()
def disk_up(disk) -> Service:
    disk.ensure_up()
    return disk


@pytest.fixture(scope="package")
def disk_good(disk) -> Iterator[GoodClient]:
    """Cycles through prompts that together overflow the KV pool and the host tier, so every
    request (after the first round) loads its prompt from the disk tier."""
    prompts = [token_ids(160, 10 + i) for i in range(DISK_PROMPTS)]
    with _good_client(lambda: disk.url, prompts, salted=False, name="disk") as good:
        again = good.run(DISK_PROMPTS)  # read back from disk: it must match the first round
        bad = [s for s in again if not s.ok or good.wrong(s)]
        assert not bad, f"the disk tier gave other answers before any attack: {bad}"
        yield good


# Loads from this index on are failed or corrupted, alternately: the warm-up round loads
# nothing (its prompts are new) and each baseline request loads once, so the baseline runs
# clean and the attack phase faulty.
FIRST_FAULTY_LOAD = PROFILE.baseline_requests


@pytest.fixture(scope="package")
def faulty(chaos_model, tmp_path_factory) -> Iterator[Service]:
    logs = tmp_path_factory.mktemp("chaos-faulty")
    k = FIRST_FAULTY_LOAD
    kv = {
        "kv_connector": "FaultInjectionConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "inner": {
                "kv_connector": "OffloadingConnector",
                "kv_connector_extra_config": {"num_cpu_chunks": 256},
            },
            "fail_loads": list(range(k, k + 2000, 2)),
            "corrupt_loads": list(range(k + 1, k + 2000, 2)),
        },
    }
    svc = serve_service("faulty", chaos_model, logs, kv=kv, num_blocks=40)
    with _running(svc):
        yield svc


@pytest.fixture(scope="package")
def faulty_good(faulty) -> Iterator[GoodClient]:
    """Like the disk client: every request after the first round loads from the host tier."""
    prompts = [token_ids(160, 20 + i) for i in range(DISK_PROMPTS)]
    with _good_client(lambda: faulty.url, prompts, salted=False, name="faulty") as good:
        yield good
