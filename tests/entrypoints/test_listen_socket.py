"""The servers' listening socket: every accepted connection sends without Nagle's delay."""

from __future__ import annotations

import asyncio
import socket

from kvferry.entrypoints.openai.http_utils import listen_socket


def test_connections_served_by_asyncio_have_tcp_nodelay() -> None:
    """asyncio turns TCP_NODELAY on only for sockets whose proto is TCP; without it a response
    body written after its headers waits for the client's delayed ACK (~40 ms)."""
    sock = listen_socket("127.0.0.1", 0, "test")
    port = sock.getsockname()[1]
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
