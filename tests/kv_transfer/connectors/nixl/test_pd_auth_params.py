"""Signed ``kv_transfer_params``: the decode side's intake refuses altered, unsigned,
foreign or expired params; without a secret nothing is signed or checked."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvferry.config import KVTransferConfig
from kvferry.kv_transfer.connectors.nixl.options import NixlOptions
from kvferry.kv_transfer.connectors.nixl.scheduler import NixlConnectorScheduler
from kvferry.kv_transfer.connectors.pd.auth import PeerAuth
from kvferry.kv_transfer.connectors.pd.params import ParamsError, decode_params
from tests.helpers.pd_auth import OTHER, _auth
from tests.helpers.scheduler import make_kv_cache_config

# -- signed params ----------------------------------------------------------------------------


def _sched(auth: PeerAuth | None) -> NixlConnectorScheduler:
    kvt = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id="P")
    config = SimpleNamespace(kv_transfer_config=kvt)
    return NixlConnectorScheduler(
        config,  # type: ignore[arg-type]
        make_kv_cache_config(64),
        NixlOptions(side_channel_port=5555),
        "P",
        auth,
    )


def _issued(auth: PeerAuth | None = None) -> dict[str, Any]:
    signer = (auth or _auth()).params
    return decode_params(
        engine_id="P",
        request_id="p-1",
        host="127.0.0.1",
        port=5555,
        block_ids=[3, 4, 9],
        num_tokens=40,
        cached_tokens=16,
        signer=signer,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"remote_host": "10.9.8.7"},
        {"remote_port": 5556},
        {"remote_engine_id": "Q"},
        {"remote_request_id": "p-2"},
        {"remote_block_ids": [3, 4, 10]},
        {"remote_prefill_cached_tokens": 0},
        {"kv_signature": None},
        {"kv_signature": "1.99999999999.deadbeef"},
        {"kv_signature": 7},
    ],
)
def test_decode_intake_refuses_altered_or_unsigned_params(change) -> None:
    sched = _sched(_auth())
    params = _issued()
    sched.validate(params)  # as issued: accepted
    forged = {**params, **change}
    if forged["kv_signature"] is None:
        del forged["kv_signature"]
    with pytest.raises(ParamsError, match="kv_signature|not signed|kv_transfer_params"):
        sched.validate(forged)


def test_params_signed_elsewhere_or_expired_are_refused() -> None:
    sched = _sched(_auth())
    with pytest.raises(ParamsError, match="does not verify"):
        sched.validate(_issued(_auth(OTHER)))
    past = _auth(clock=lambda: time.time() - 3600)
    with pytest.raises(ParamsError, match="expired"):
        sched.validate(_issued(past))
    # Without a secret nothing is signed and nothing is checked.
    plain = _sched(None)
    params = _issued()
    del params["kv_signature"]
    plain.validate(params)
