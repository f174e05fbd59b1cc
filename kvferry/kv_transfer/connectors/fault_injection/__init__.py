"""FaultInjectionConnector: wraps any connector and fails, corrupts or delays chosen loads and
stores, or raises from a chosen hook, so the engine's failure handling can be tested (and a
connector's author can see what the engine does when that connector misbehaves).

The wrapped connector does its work unchanged; the faults are applied at the protocol
boundary, where the engine sees them:

* a *failed load* is reported as failed, through the protocol: a synchronous load's blocks via
  ``get_block_ids_with_load_errors``, an asynchronous load's request via ``get_failed_recving``
  (with its ``finished_recving``), so ``kv_load_failure_policy`` applies ("fail" ends the
  request with finish reason ``error``, "recompute" computes the KV again);
* a *corrupt load* overwrites the loaded blocks with garbage once the wrapped connector has
  written them, and reports them failed (a connector that verifies checksums);
* a *delayed load* holds a synchronous load in ``start_load_kv``, or holds back an
  asynchronous load's ``finished_recving`` report, for the given time;
* a *failed store* is a store whose data does not survive: a later load that covers any block
  it saved is reported failed, until a later store saves that block again (needs prefix
  caching, which names blocks by hash);
* a *delayed store* holds ``wait_for_save`` of the step that computed it;
* ``raise_in``: the named hook raises :class:`InjectedFault` after the wrapped connector's
  call returned (for fault-isolation tests).

Modules: :mod:`.options` (the ``kv_connector_extra_config`` keys, documented there),
:mod:`.planner` (which loads and stores to sabotage, scheduler side), :mod:`.metadata` (the
planned faults, scheduler -> worker), :mod:`.connector` (the wrapper, both roles).
"""

from kvferry.kv_transfer.connectors.fault_injection.connector import FaultInjectionConnector
from kvferry.kv_transfer.connectors.fault_injection.metadata import (
    FaultInjectionMetadata,
    InjectedLoad,
)
from kvferry.kv_transfer.connectors.fault_injection.options import (
    HOOKS,
    FaultInjectionOptions,
    InjectedFault,
    inner_config,
)

__all__ = [
    "HOOKS",
    "FaultInjectionConnector",
    "FaultInjectionMetadata",
    "FaultInjectionOptions",
    "InjectedFault",
    "InjectedLoad",
    "inner_config",
]
