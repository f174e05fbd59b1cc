"""ExampleHiddenStatesConnector (see :mod:`.connector`) and the helpers clients read its
files with (:func:`load_hidden_states`, :func:`cleanup_hidden_states`)."""

from kvferry.kv_transfer.connectors.example_hidden_states.connector import (
    ExampleHiddenStatesConnector,
)
from kvferry.kv_transfer.connectors.example_hidden_states.files import (
    cleanup_hidden_states,
    load_hidden_states,
)
from kvferry.kv_transfer.connectors.example_hidden_states.metadata import (
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

__all__ = [
    "ExampleHiddenStatesConnector",
    "ExampleHiddenStatesConnectorMetadata",
    "PendingSave",
    "cleanup_hidden_states",
    "load_hidden_states",
]
