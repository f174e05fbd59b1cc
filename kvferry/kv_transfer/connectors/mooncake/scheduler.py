"""The scheduler side of the MooncakeConnector: the shared P/D scheduler with vLLM's
MooncakeConnector fields in the params it returns.

A prefill request may carry vLLM's ``transfer_id`` (a proxy's name for the transfer); the
params a prefill instance returns echo it (else the request id) and add
``remote_bootstrap_addr``, the side channel as ``tcp://host:port``. kvferry reads with its
signed fields (``remote_host``, ``remote_port``, ``remote_block_ids``, ...); a decode request
whose ``remote_bootstrap_addr`` or ``transfer_id`` contradicts them is refused at intake.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.kv_transfer.connectors.pd.params import ParamsError, RemoteParams
from kvferry.kv_transfer.connectors.pd.scheduler import PDConnectorScheduler

if TYPE_CHECKING:
    from kvferry.request import Request

MAX_TRANSFER_ID = 256


def bootstrap_addr(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


class MooncakeConnectorScheduler(PDConnectorScheduler):
    label = "Mooncake"

    def extra_params(self, request: Request, host: str, port: int) -> dict[str, Any]:
        params = request.kv_transfer_params or {}
        tid = params.get("transfer_id")
        if not (isinstance(tid, str) and 0 < len(tid) <= MAX_TRANSFER_ID):
            tid = request.request_id
        return {"transfer_id": tid, "remote_bootstrap_addr": bootstrap_addr(host, port)}

    def checked(self, params: dict[str, Any]) -> RemoteParams:
        remote = super().checked(params)
        addr = params.get("remote_bootstrap_addr")
        if addr is not None and addr != bootstrap_addr(remote.remote_host, remote.remote_port):
            raise ParamsError(
                f"kv_transfer_params: remote_bootstrap_addr {str(addr)[:300]!r} is not the "
                f"remote_host and remote_port it comes with"
            )
        tid = params.get("transfer_id")
        if tid is not None and not (isinstance(tid, str) and 0 < len(tid) <= MAX_TRANSFER_ID):
            raise ParamsError(
                f"kv_transfer_params: transfer_id must be a string of 1 to {MAX_TRANSFER_ID} "
                f"characters"
            )
        return remote
