"""What the ExampleHiddenStatesConnector's scheduler half tells its worker half each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorMetadata


@dataclass
class PendingSave:
    """Write the hidden states of ``token_ids`` (the request's first tokens, one per slot of
    ``block_ids`` in order) to ``filename``. ``delayed_free``: the request has finished and
    its blocks are kept for this save; the worker reports it in ``finished_sending`` once the
    rows are copied out."""

    req_id: str
    filename: str
    token_ids: list[int]
    block_ids: list[int]
    delayed_free: bool = False


@dataclass
class ExampleHiddenStatesConnectorMetadata(KVConnectorMetadata):
    pending_saves: list[PendingSave] = field(default_factory=list)
    # Requests scheduled for the first time -> their file: the worker takes the file's lock
    # before the caller can learn the path.
    new_req_filenames: dict[str, str] = field(default_factory=dict)
