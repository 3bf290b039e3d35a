"""TCP addresses of the doors: one rule for IPv6 brackets, one way to bind."""

from __future__ import annotations

import socket


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (URLs, gRPC and ZMQ addresses)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_tcp(host: str, port: int) -> socket.socket:
    """A bound TCP socket (not yet listening): a port in use fails here, before the engine
    starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP. With Nagle on, a stream's first token waited ~40 ms
    # in the kernel for the client's delayed ACK of the response headers.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
