"""The HTTP listening socket: connections accepted on it stream with Nagle's algorithm off, so a
token's SSE chunk leaves at once instead of waiting for the client's delayed ACK (~40 ms)."""

from __future__ import annotations

import asyncio
import socket

from engine.server.net import bind_tcp as _bind


def test_accepted_connections_have_tcp_nodelay():
    async def main() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = _bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
