"""A proxy that refuses: the agent CLIs get it as HTTP_PROXY/HTTPS_PROXY/ALL_PROXY (with
NO_PROXY for loopback), so any attempt to reach a host other than the gateway fails at
once (403) instead of waiting on a network that CI does not have, and the attempt is
recorded (``host:port``) for the test to report or assert on.

A client that ignores proxy variables is not caught here (Node's own ``fetch`` ignores
them); those attempts fail on CI's missing network instead.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator


class Refusals:
    """The ``host:port`` targets refused so far, in order (``tried``)."""

    def __init__(self) -> None:
        self.tried: list[str] = []
        self.lock = threading.Lock()

    def add(self, target: str) -> None:
        with self.lock:
            self.tried.append(target)


def _target(request_line: str) -> str:
    """``host:port`` of a proxy request line (``CONNECT h:p HTTP/1.1`` or ``GET http://h/...``)."""
    parts = request_line.split()
    if len(parts) < 2:
        return request_line.strip()[:80]
    method, url = parts[0], parts[1]
    if method.upper() == "CONNECT":
        return url
    host = url.split("://", 1)[-1].split("/", 1)[0]
    return host if ":" in host else f"{host}:{443 if url.startswith('https') else 80}"


@contextlib.contextmanager
def refusing_proxy() -> Iterator[tuple[str, Refusals]]:
    """Serve the refusing proxy on a loopback port until the block ends; yields its URL
    (``http://127.0.0.1:PORT``) and the :class:`Refusals` it records."""
    refusals = Refusals()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                head = conn.recv(8192).decode("latin-1")
            except OSError:
                return
            if head:
                refusals.add(_target(head.split("\r\n", 1)[0]))
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", refusals
    finally:
        stop.set()
        thread.join(5)
        listener.close()
