"""``kvferry proxy``: the router in front of kvferry servers.

Two modes: plain instances (``--instance URL...``: each request served whole by one
instance) and prefill/decode disaggregation (``--prefill URL... --decode URL...``, see
:mod:`.pd`). ``--policy round_robin|least_loaded|kv_aware`` picks the instance (the prefill
instance in P/D); kv_aware follows every instance's KV cache events into a prefix index and
sends a prompt where its longest prefix is cached (see :mod:`.policies`). ``/health`` checks
every instance; ``/metrics`` has the proxy's own counters and its routing decisions.

Upstream authentication: with ``--upstream-api-key-file FILE`` every call to an instance
carries ``Authorization: Bearer <the file's content>`` instead of whatever the client sent, so
the instances' ``--api-key`` also covers the proxy's releases. Without it the client's
``Authorization`` header is passed on as is.
"""

from kvferry.entrypoints.openai.http_utils import read_api_key_file
from kvferry.entrypoints.proxy.app import build_proxy_app, make_proxy, run_proxy
from kvferry.entrypoints.proxy.common import normalize_url
from kvferry.entrypoints.proxy.instances import InstanceProxy
from kvferry.entrypoints.proxy.pd import PREFILL_KV_PARAMS, PDProxy
from kvferry.entrypoints.proxy.router import Router, RouterConfig

__all__ = [
    "PREFILL_KV_PARAMS",
    "InstanceProxy",
    "PDProxy",
    "Router",
    "RouterConfig",
    "build_proxy_app",
    "make_proxy",
    "normalize_url",
    "read_api_key_file",
    "run_proxy",
]
