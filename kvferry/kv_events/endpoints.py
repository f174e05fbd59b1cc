"""ZMQ endpoints of the event publisher: bind or connect, and the per-rank endpoint."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_bind_endpoint", "offset_endpoint_port", "tcp_host"]


def tcp_host(endpoint: str) -> str:
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_local_ip(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    # An address this host owns is one the OS lets us bind.
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def is_bind_endpoint(endpoint: str) -> bool:
    """Bind ipc/inproc, wildcard and local tcp endpoints; connect to any other host."""
    if not endpoint.startswith("tcp://"):
        return True
    host = tcp_host(endpoint)
    if "*" in host or host in ("", "localhost", socket.gethostname()):
        return True
    return _is_local_ip(host)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-rank endpoint: tcp port + rank (port 0 stays 0), inproc name + suffix."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by data-parallel rank")
