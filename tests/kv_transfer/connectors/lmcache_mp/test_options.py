"""LMCacheMPConnector options (LMCache's own ``lmcache.mp.*`` keys) and its clear errors:
bad values, unknown keys, keys kvferry does not implement, no server, no LMCache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvferry.config import ConfigError
from kvferry.kv_transfer.connectors.lmcache_mp.options import parse_lmcache_options
from tests.helpers.ports import _dead_port

ROOT = Path(__file__).resolve().parents[4]
OWNER = "LMCacheMPConnector"
pytestmark = pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")


def test_defaults_match_lmcache() -> None:
    opts = parse_lmcache_options({}, OWNER)
    assert opts.server_url == "tcp://localhost:5555"
    assert (opts.mq_timeout, opts.heartbeat_interval) == (300.0, 10.0)
    cfg = opts.adapter_config()
    assert cfg["lmcache.mp.mq_timeout"] == 300.0
    assert "lmcache.mp.mp_transfer_mode" not in cfg  # leaves LMCACHE_MP_TRANSFER_MODE alone


@pytest.mark.parametrize(
    ("extra", "url"),
    [
        ({"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 6000}, "tcp://127.0.0.1:6000"),
        ({"lmcache.mp.host": "10.0.0.2", "lmcache.mp.port": "6001"}, "tcp://10.0.0.2:6001"),
        ({"lmcache.mp.server_urls": "127.0.0.1:7000"}, "tcp://127.0.0.1:7000"),
        ({"lmcache.mp.server_urls": ["tcp://h:7001"], "lmcache.mp.port": 1}, "tcp://h:7001"),
    ],
)
def test_server_address_as_vllm_reads_it(extra: dict[str, Any], url: str) -> None:
    assert parse_lmcache_options(extra, OWNER).server_url == url


def test_string_values_are_coerced_as_lmcache_does() -> None:
    opts = parse_lmcache_options(
        {
            "lmcache.mp.mq_timeout": "12.5",
            "lmcache.mp.heartbeat_interval": 2,
            "lmcache.mp.nonblocking_lookup_status": "off",
            "lmcache.mp.mp_transfer_mode": "engine_driven",
            "lmcache.mp.eager_prefetch": "yes",
        },
        OWNER,
    )
    assert (opts.mq_timeout, opts.heartbeat_interval) == (12.5, 2.0)
    assert opts.nonblocking_lookup_status is False and opts.eager_prefetch is True
    assert opts.adapter_config()["lmcache.mp.mp_transfer_mode"] == "engine_driven"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lmcache.mp.port": 0}, "port must be in 1..65535"),
        ({"lmcache.mp.port": "x"}, "port must be an integer"),
        ({"lmcache.mp.port": 5555.5}, "port must be an integer"),
        ({"lmcache.mp.mq_timeout": -1}, "mq_timeout must be a positive"),
        ({"lmcache.mp.heartbeat_interval": "nan"}, "heartbeat_interval must be a positive"),
        ({"lmcache.mp.heartbeat_interval": True}, "must be a number"),
        ({"lmcache.mp.isolated_ipc": "maybe"}, "isolated_ipc must be a boolean"),
        ({"lmcache.mp.mp_transfer_mode": "magic"}, "mp_transfer_mode must be one of"),
        ({"lmcache.mp.hash_algorithm": "md5"}, "hash_algorithm must be one of"),
        ({"lmcache.mp.host": ""}, "host must be a non-empty string"),
        ({"lmcache.mp.server_urls": "a:1,b:2"}, "exactly one server"),
        ({"lmcache.mp.server_urls": 5}, "list of URLs"),
        ({"lmcache.mp.save_decode_cache": True}, "save_decode_cache=True is not supported"),
        ({"lmcache.mp.lazy_offload": True}, "lmcache.mp.lazy_offload is not supported"),
        ({"lmcache.mp.autostart": True}, "lmcache.mp.autostart is not supported"),
        (
            {"lmcache.mp.bogus": 1},
            "unknown kv_connector_extra_config option(s) ['lmcache.mp.bogus']",
        ),
        ({"cpu_bytes_to_use": 1}, "valid options are ['lmcache.mp.eager_prefetch'"),
    ],
)
def test_bad_options_are_refused_clearly(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_lmcache_options(extra, OWNER)
    assert message in str(e.value)
    assert str(e.value).startswith(OWNER)


def test_engine_refuses_bad_options_and_an_unreachable_server(tiny_model_factory) -> None:
    from kvferry import LLM

    model = str(tiny_model_factory("llama"))
    kv: dict[str, Any] = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config"):
        LLM(model=model, kv_transfer_config={**kv, "kv_connector_extra_config": {"x": 1}})
    pytest.importorskip("lmcache")
    dead = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": _dead_port()}
    dead["lmcache.mp.mq_timeout"] = 0.5  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="Cannot reach the LMCache MP server"):
        LLM(model=model, kv_transfer_config={**kv, "kv_connector_extra_config": dead})


_WITHOUT_LMCACHE = textwrap.dedent(
    """
    import json, sys
    from importlib.abc import MetaPathFinder

    class NoLMCache(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "lmcache" or name.startswith("lmcache."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoLMCache())
    from kvferry import LLM
    from kvferry.config import ConfigError
    kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}
    try:
        LLM(model=sys.argv[1], kv_transfer_config=kv)
    except ConfigError as e:
        print(json.dumps({"error": str(e)}))
    """
)


def test_absent_lmcache_is_a_clear_error_not_a_traceback(tiny_model_factory) -> None:
    model = str(tiny_model_factory("llama"))
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LMCACHE, model],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert error.startswith(
        "LMCacheMPConnector needs LMCache: pip install --no-deps lmcache==0.5.6 "
        "&& pip install 'kvferry[lmcache]'"
    )
