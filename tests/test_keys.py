"""The single API key from ``MLX_GATEWAY_API_KEY`` or ``--api-key-file`` (kept out of
``ps``), refused with ``--tenants``; the warning for an open non-loopback host; and the
401 that explains why an admin key may not generate."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port, live_server, model_path
from gateway.config import ServeConfig
from gateway.server import tenant_table
from gateway.tenancy.tenants import hash_key

CLI = [sys.executable, "-m", "gateway.cli"]
KEY = "mgw-test-key-0123456789"


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv("MLX_GATEWAY_API_KEY", raising=False)


def serve_args(*args: str) -> list[str]:
    return [*CLI, "serve", "--model", str(model_path("qwen3")), "--port", str(free_port()), *args]


def refused(*args: str, env: dict | None = None) -> str:
    """stderr of a ``serve`` that must exit at start-up."""
    r = subprocess.run(serve_args(*args), capture_output=True, text=True, timeout=60,
                       env={**os.environ, **(env or {})})
    assert r.returncode != 0
    return r.stderr


def test_the_key_from_the_environment_is_required_and_not_on_the_command_line():
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model_path("qwen3")), "--port", str(port)],
                            env={**os.environ, "MLX_GATEWAY_API_KEY": KEY},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
            body = {"prompt": "hi", "max_tokens": 2}
            assert c.post("/v1/completions", json=body).status_code == 401
            assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        if os.path.exists(f"/proc/{proc.pid}/cmdline"):
            assert KEY.encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
    finally:
        proc.kill()
        proc.wait()


def test_the_key_file_gives_its_first_line(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {KEY}  \nnot the key\n")
    table = tenant_table(ServeConfig(api_key_file=str(path)))
    assert table.requires_key
    tenant, admin = table.authenticate(KEY)
    assert tenant is not None and admin
    assert table.authenticate("not the key") == (None, False)


def test_a_flag_key_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_API_KEY", "from-env")
    table = tenant_table(ServeConfig(api_key=KEY))
    assert table.authenticate(KEY)[0] is not None and table.authenticate("from-env")[0] is None
    from_env = tenant_table(ServeConfig())
    assert from_env.requires_key and from_env.authenticate("from-env")[0] is not None
    monkeypatch.setenv("MLX_GATEWAY_API_KEY", "  ")  # blank: unset
    assert not tenant_table(ServeConfig()).requires_key


def test_a_missing_or_empty_key_file_is_refused(tmp_path):
    assert "cannot read" in refused("--api-key-file", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "first line is empty" in refused("--api-key-file", str(empty))
    both = tmp_path / "key"
    both.write_text(KEY)
    assert "not both" in refused("--api-key", KEY, "--api-key-file", str(both))


def test_a_single_key_with_tenants_is_refused(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.app]\nkey_sha256 = ["{hash_key(KEY)}"]\n')
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY)
    for args, env, named in [(["--api-key", KEY], None, "--api-key"),
                             (["--api-key-file", str(keyfile)], None, "--api-key-file"),
                             ([], {"MLX_GATEWAY_API_KEY": KEY}, "MLX_GATEWAY_API_KEY")]:
        err = refused("--tenants", str(tenants), *args, env=env)
        assert "--tenants" in err and named in err and "key_sha256" in err, err
        assert KEY not in err


def test_an_open_non_loopback_host_is_logged_as_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="mlx_gateway"):
        table = tenant_table(ServeConfig(host="0.0.0.0", allow_unauthenticated=True))
    assert not table.requires_key
    assert any(r.levelno == logging.WARNING and "WITHOUT API keys" in r.getMessage() and "0.0.0.0" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_gateway"):
        tenant_table(ServeConfig(host="127.0.0.1"))
    assert not caplog.records


def test_an_admin_key_on_a_generation_route_gets_an_explanation(tmp_path):
    admin, user = "mgw-admin-key", "mgw-user-key"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[admin]\nkey_sha256 = ["{hash_key(admin)}"]\n'
                       f'[tenants.app]\nkey_sha256 = ["{hash_key(user)}"]\n')
    with live_server(model_path("qwen3"), tenants=str(tenants)) as server, server.client() as c:
        as_admin = {"Authorization": f"Bearer {admin}"}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=chat, headers=as_admin)
        assert r.status_code == 401
        msg = r.json()["error"]["message"]
        assert "admin key" in msg and "/v1/usage" in msg and "/admin/" in msg and "tenant" in msg, msg
        r = c.post("/v1/messages", json=chat, headers={"x-api-key": admin})
        assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
        # An unknown key still gets the plain answer; the admin key keeps its own routes.
        r = c.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer nobody"})
        assert r.status_code == 401 and "admin" not in r.json()["error"]["message"]
        assert c.get("/v1/usage", headers=as_admin).status_code == 200
        assert c.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {user}"}).status_code == 200
