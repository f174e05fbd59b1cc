"""The NIXL library behind the connector (its ``KVTransport``, see
:mod:`kvferry.kv_transfer.connectors.pd.transport`): one agent per worker, the KV pool
registered with it, and block-granular READs from a peer's pool.

Every layer's KV tensor ``(2, num_blocks, block_size, kv_heads, head_dim)`` is one registered
region. Transfers use one descriptor per (layer, K|V, block) in that order, so a request's
blocks map to the same descriptor indices on both sides and runs of consecutive blocks merge
into single large transfers. Host tensors are registered as DRAM, CUDA tensors as VRAM: the
same code moves host memory over TCP and device memory over RDMA/NVLink, as UCX allows.

All calls must come from one thread (the engine's); the agent is created without locking.

The backend's progress thread sleeps on UCX's event descriptors and wakes at least every
``progress_interval`` seconds (the NIXL Python API would have it poll without ever sleeping,
a full core while idle). UCX listens only on the interface of the configured side-channel
host when that is one address of this machine (``UCX_NET_DEVICES``, unless the user set it).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry.kv_layout import physical
from kvferry.kv_transfer.connectors.pd.handshake import AgentInfo, ProtocolError
from kvferry.kv_transfer.connectors.pd.transport import KVLayout

logger = logging.getLogger(__name__)


@dataclass
class RemotePeer:
    name: str
    layout: KVLayout
    dlist: Any  # nixl_prepped_dlist_handle


def _rows(addrs: np.ndarray, length: int, device_id: int) -> np.ndarray:
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = device_id
    return out


UCX_MODULES_DEFAULT = "^*efa*"
_SIOCGIFADDR = 0x8915
_AGENT_CONFIG_LOCK = threading.Lock()


def _interface_of(ip: str) -> str | None:
    """The network interface whose (first IPv4) address is ``ip``; None if none or unknown."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name[:15].encode())
                if socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24]) == ip:
                    return name
    return None


def _rdma_ports() -> list[str]:
    """UCX names (``device:port``) of this machine's RDMA ports: they listen on no IP."""
    root = Path("/sys/class/infiniband")
    with contextlib.suppress(OSError):
        return sorted(f"{d.name}:{p.name}" for d in root.iterdir() for p in (d / "ports").iterdir())
    return []


def ucx_net_devices(host: str) -> str | None:
    """The ``UCX_NET_DEVICES`` that keeps UCX's TCP listeners on the interface of ``host``
    (RDMA ports stay usable), or None to leave UCX's choice: a wildcard, a name or an
    address of no interface here."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if ip.is_loopback:
        return _interface_of("127.0.0.1") or "lo"
    if ip.version != 4 or ip.is_unspecified:
        return None
    iface = _interface_of(str(ip))
    return ",".join([iface, *_rdma_ports()]) if iface is not None else None


@contextlib.contextmanager
def _agent_settings(api: Any, progress_delay_us: int, net_devices: str | None) -> Iterator[None]:
    """While a NIXL agent is built: UCX's device list (when the user set none), and a
    progress-thread wake-up delay. ``nixl_agent`` hard-codes that delay to zero, which makes
    the thread poll UCX without ever sleeping; an agent config whose ``pthrDelay`` cannot
    go below ours is swapped in for the construction (the NIXL bindings allow subclasses)."""
    bind: Any = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    patch = progress_delay_us > 0 and base is not None and hasattr(base, "pthrDelay")
    set_env = net_devices is not None and "UCX_NET_DEVICES" not in os.environ
    with _AGENT_CONFIG_LOCK:
        if patch:

            class _Config(base):  # type: ignore[misc, valid-type]
                def __setattr__(self, key: str, value: Any) -> None:
                    if key == "pthrDelay":
                        value = max(int(value), progress_delay_us)
                    super().__setattr__(key, value)

            bind.nixlAgentConfig = _Config
        if set_env:
            os.environ["UCX_NET_DEVICES"] = str(net_devices)
        try:
            yield
        finally:
            if patch:
                bind.nixlAgentConfig = base
            if set_env:
                os.environ.pop("UCX_NET_DEVICES", None)


class NixlTransport:
    label = "NIXL"

    def __init__(
        self,
        name: str,
        backends: list[str],
        num_threads: int = 0,
        progress_interval: float = 0.01,
        bind_host: str | None = None,
    ) -> None:
        # NIXL's UCX loads its EFA module, which pulls in the system's libibverbs and a second
        # libnl-route next to the wheel's; their exit handlers then crash the process
        # (SIGSEGV at interpreter exit) wherever libibverbs1 is installed, as Mooncake needs.
        # EFA exists only on AWS; UCX_MODULES set by the user wins.
        os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)
        try:
            from nixl import _api
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise RuntimeError(f"NixlConnector needs the nixl package: {e}") from None
        cfg = nixl_agent_config(backends=list(backends), num_threads=num_threads)
        self.name = name
        devices = ucx_net_devices(bind_host) if bind_host else None
        with _agent_settings(_api, round(progress_interval * 1e6), devices):
            self.agent = nixl_agent(name, cfg)
        if not self.agent.backends:
            raise RuntimeError(
                f"NixlConnector: none of the NIXL backends {backends} could be created "
                f"(plugins found: {self.agent.get_plugin_list()})"
            )
        self._reg: Any = None
        self._local: Any = None
        self.layout: KVLayout | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> KVLayout:
        layout = KVLayout.of_caches(kv_caches)
        # One region per distinct tensor (a hybrid model's groups share them, see KVLayout).
        # In memory order: NIXL registers contiguous tensors (an HND pool's permuted view is not).
        unique = list({t.data_ptr(): physical(t) for t in kv_caches.values()}.values())
        self._reg = self.agent.register_memory(unique)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", layout.descs(), layout.mem_type)
        self.layout = layout
        return layout

    def describe(self) -> str:
        return "backends=" + ",".join(self.agent.backends)

    @property
    def local_dlist(self) -> Any:
        """The prepared descriptor list of the local pool (for raw transfers in benchmarks)."""
        return self._local

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, info: AgentInfo) -> RemotePeer:
        raw = self.agent.add_remote_agent(info.agent_metadata)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if name != info.agent_name:
            self.agent.remove_remote_agent(name)
            raise ProtocolError(
                f"peer announced NIXL agent {info.agent_name!r} but its metadata is {name!r}"
            )
        layout = KVLayout.of_peer(info)
        dlist = self.agent.prep_xfer_dlist(name, layout.descs(), layout.mem_type)
        return RemotePeer(name, layout, dlist)

    def remove_peer(self, peer: RemotePeer) -> None:
        try:
            peer.dlist.release()
            self.agent.remove_remote_agent(peer.name)
        except Exception as e:  # the peer may be gone already
            logger.debug("NIXL: removing peer %s: %s", peer.name, e)

    def read(
        self, peer: RemotePeer, local_ids: list[int], remote_ids: list[int], notif: bytes
    ) -> tuple[Any, str]:
        """Post a READ of ``remote_ids`` into ``local_ids``; returns (handle, state)."""
        assert self.layout is not None
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local,
            self.layout.indices(local_ids),
            peer.dlist,
            peer.layout.indices(remote_ids),
            notif,
        )
        try:
            return handle, self.agent.transfer(handle)
        except Exception:
            self.release(handle)
            raise

    def read_pieces(
        self,
        peer: RemotePeer,
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        length: int,
        notif: bytes,
    ) -> tuple[Any, str]:
        """A READ of arbitrary pieces: descriptor lists made for this transfer only (a
        prepared list of every piece of the pool would be ``block_size`` times larger)."""
        assert self.layout is not None
        local = self.agent.get_xfer_descs(
            _rows(local_addrs, length, self.layout.device_id), self.layout.mem_type
        )
        remote = self.agent.get_xfer_descs(
            _rows(remote_addrs, length, peer.layout.device_id), peer.layout.mem_type
        )
        handle = self.agent.initialize_xfer("READ", local, remote, peer.name, notif)
        try:
            return handle, self.agent.transfer(handle)
        except Exception:
            self.release(handle)
            raise

    def state(self, handle: Any) -> str:
        return str(self.agent.check_xfer_state(handle))

    def release(self, handle: Any) -> bool:
        """Release a transfer handle (cancelling it if still active); False if NIXL refused."""
        try:
            self.agent.release_xfer_handle(handle)
            return True
        except Exception as e:
            logger.warning("NIXL: cannot release a transfer handle yet: %s", e)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        return dict(self.agent.get_new_notifs())

    def close(self) -> None:
        try:
            if self._local is not None:
                self._local.release()
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("NIXL: close: %s", e)
        self._local = self._reg = None
