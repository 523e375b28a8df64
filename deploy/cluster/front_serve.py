"""Serving the cluster front (``front.py``): uvicorn, and what a restart without a gap
needs.

``--reuse-port`` binds with ``SO_REUSEPORT`` (:func:`listening_socket`), so a new front can
start on the port of the one it replaces; the kernel then spreads new connections over
both. At SIGTERM the old one first drains for ``--drain-seconds`` (2 s by default with
``--reuse-port``): it still serves, but every answer says ``Connection: close``
(:class:`CloseWhileDraining`), so clients take their next request to a new connection
rather than one about to close; then it stops as uvicorn does (it takes no new connection
and waits for the answers it relays).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading

import uvicorn

log = logging.getLogger("mlx_gateway.front")


class CloseWhileDraining:
    """ASGI wrapper: while ``front.draining``, every answer says ``Connection: close``."""

    def __init__(self, app, front):
        self.app, self.front = app, front

    async def __call__(self, scope, receive, send):
        async def sending(message):
            if message["type"] == "http.response.start" and self.front.draining:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
        await self.app(scope, receive, sending if scope["type"] == "http" else send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM first sets ``front.draining`` for ``drain`` seconds
    (still serving), then stops as uvicorn does."""

    def __init__(self, config: uvicorn.Config, front, drain: float):
        super().__init__(config)
        self.front, self.drain = front, drain

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and self.drain > 0 and not self.front.draining:
            self.front.draining = True
            log.info("SIGTERM: draining for %.1f s, then stopping", self.drain)
            timer = threading.Timer(self.drain, super().handle_exit, (sig, frame))
            timer.daemon = True
            timer.start()
            return
        super().handle_exit(sig, frame)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` with ``SO_REUSEPORT``: a second front started on
    the same port shares it (the kernel spreads new connections over both), so a restart
    can start the new front first and then stop the old one (SIGTERM: it stops taking
    connections and finishes the answers it relays) without refusing any connection.

    Raises:
        OSError: the port is taken by a process without ``SO_REUSEPORT``, or the system has
            no ``SO_REUSEPORT`` (Windows).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(app, front, host: str, port: int, log_level: str, reuse_port: bool, drain: float) -> None:
    """Run ``app`` (the front's ASGI app; ``front`` has a ``draining`` flag) until stopped.

    Raises:
        OSError: the port is taken (by a process without ``SO_REUSEPORT`` when ``reuse_port``).
    """
    config = uvicorn.Config(CloseWhileDraining(app, front), host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="on")
    server = DrainingServer(config, front, drain)
    server.run(sockets=[listening_socket(host, port)] if reuse_port else None)
