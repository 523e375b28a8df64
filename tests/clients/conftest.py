"""The client matrix's server and guards: real client libraries against a real gateway.

One ``mlx-gateway serve --model demo`` subprocess serves every test in this directory (the
``gateway`` fixture, package-scoped): the demo model is a tiny qwen3 with random weights on
the project's own BPE and a ChatML template that thinks Qwen3-style, so answers are random
text. The tests therefore drive every tool loop with forced calls (``tool_choice``
required or named, which the gateway constrains with a grammar) and every structured result
with bounded schemas, and assert protocol facts only: shapes, indexes, ids, finish and stop
reasons, usage sums, error types.

Nothing here may reach the network: CI has none but package registries. Before the client
libraries are imported, their remote lookups are turned off (``common.QUIET_ENV``:
litellm's cost map download, the openai-agents trace exporter, LangSmith tracing); while a
test of this directory runs, a socket guard refuses, and records, any connection or name
lookup that is not loopback, and the package's teardown fails when one was tried.
Subprocesses (the server, the ``llm`` CLI) get no hub and proxies on a dead loopback port
(``common.OFFLINE_ENV``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, free_port, wait_until
from gateway.models.demo_model import default_demo_dir

from .common import MAX_TOKENS, MODEL, OFFLINE_ENV, QUIET_ENV

# Turned off in this process before the client libraries are imported (pytest imports this
# file before the test modules): without it litellm downloads its model cost map at import.
os.environ.update(QUIET_ENV)


# ---------------------------------------------------------------------- network guard
def _loopback(host) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(scope="package", autouse=True)
def no_network():
    """Refuse (OSError) and record every non-loopback connection or name lookup made in
    this process while the package's tests run; fail at the end if there was one."""
    tried: list[str] = []
    real_connect, real_connect_ex, real_getaddrinfo = (socket.socket.connect, socket.socket.connect_ex,
                                                       socket.getaddrinfo)

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            tried.append(f"connect {address}")
            raise OSError(f"tests/clients: no network, refused a connection to {address}")

    def connect(sock, address):
        check(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        check(sock, address)
        return real_connect_ex(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not _loopback(host.decode() if isinstance(host, bytes) else host):
            tried.append(f"lookup {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"tests/clients: no network, refused to look up {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        yield tried
    assert not tried, f"the client libraries tried to reach the network: {tried}"


# ---------------------------------------------------------------------- the server
class GatewayProcess:
    """The running server: ``url`` (no path), ``v1`` (``url + "/v1"``), ``log`` (its output),
    ``home`` (its ``MLX_GATEWAY_HOME``, where the demo model is built)."""

    def __init__(self, url: str, log: Path, home: Path):
        self.url, self.v1, self.log, self.home = url, url + "/v1", log, home

    def token_id(self, token: str) -> int:
        """The id of ``token`` in the demo model's tokenizer."""
        from tokenizers import Tokenizer

        model_dir = self.home / default_demo_dir().name
        token_id = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(token)
        assert token_id is not None, f"no {token} in the demo model's tokenizer"
        return token_id

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="package")
def gateway(tmp_path_factory) -> GatewayProcess:
    """``mlx-gateway serve --model demo`` on a free loopback port, until the package ends.

    The demo model is built (once, a second) under ``.test-models/clients``; the server runs
    in an empty directory so that no ``./demo`` folder shadows ``demo``.
    """
    port = free_port()
    workdir = tmp_path_factory.mktemp("gateway")
    log = workdir / "serve.log"
    home = Path(os.environ.get("MLX_GATEWAY_TEST_MODELS", ROOT / ".test-models")) / "clients"
    script = Path(sys.executable).with_name("mlx-gateway")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]
    cmd += ["serve", "--model", "demo", "--port", str(port), "--max-tokens", str(MAX_TOKENS),
            "--shutdown-grace", "1", "--log-level", "WARNING"]
    env = {**os.environ, **OFFLINE_ENV, "MLX_GATEWAY_HOME": str(home)}
    server = GatewayProcess(f"http://127.0.0.1:{port}", log, home)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx-gateway exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            r = httpx.get(server.url + "/health", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json()["models"].get(MODEL) == "loaded"

    try:
        wait_until(ready, 120, "mlx-gateway serve --model demo to load its model", interval=0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="package")
def llm_user_dir(gateway, tmp_path_factory) -> Path:
    """An ``llm`` user directory whose ``extra-openai-models.yaml`` declares the gateway's
    model twice: ``gw-chat`` over Chat Completions, ``gw-responses`` over Responses."""
    d = tmp_path_factory.mktemp("llm-user")
    entry = {"model_name": MODEL, "api_base": gateway.v1, "supports_schema": True, "supports_tools": True}
    models = [{"model_id": "gw-chat", **entry}, {"model_id": "gw-responses", **entry, "responses": True}]
    (d / "extra-openai-models.yaml").write_text(yaml.safe_dump(models, sort_keys=False))
    return d
