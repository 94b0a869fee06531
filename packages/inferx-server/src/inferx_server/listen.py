"""The listening socket, in a module of its own: `inferx-server` binds it before loading the
model (a taken port is reported at once), without importing the HTTP stack to do so."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (see getsockname())."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock
