"""Open mode is safe from web pages, and input types are strict, over HTTP on a tiny real
model: bodies must be declared ``application/json`` (415 otherwise, in each API's error
shape), the ``Host`` header must name this server (421 otherwise: DNS rebinding),
``--metrics-key`` guards ``/metrics``, and a string is never read as a number or a
boolean (400 naming the field)."""

from __future__ import annotations

import socket

import pytest

from conftest import live_server, model_path
from gateway.http.hosts import HostPolicy, host_name, machine_names

MSG = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"model": "test-model", "messages": MSG, "max_tokens": 2},
    "/v1/completions": {"model": "test-model", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "test-model", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "test-model", "messages": MSG, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "test-model", "messages": MSG},
}
OPENAI_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3")) as s:
        yield s


def openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == OPENAI_KEYS and err["message"], err
    return err


def anthropic_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


# ---------------------------------------------------------------------- 1. Content-Type
def _raw(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "application/jsonx", "text/json"])
@pytest.mark.parametrize("route", list(BODIES))
def test_a_body_not_declared_as_json_is_a_415(server, route, ctype):
    admitted = server.engine.stats.admitted
    headers = {} if ctype is None else {"content-type": ctype}
    with server.client() as c:
        r = c.post(route, content=_raw(BODIES[route]), headers=headers)
    if route.startswith("/v1/messages"):
        err = anthropic_error(r, 415)
        assert err["type"] == "invalid_request_error"
    else:
        err = openai_error(r, 415)
        assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"
    assert "application/json" in err["message"]
    assert server.engine.stats.admitted == admitted, "a 415 request reached the engine"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_the_media_type_is_compared_without_parameters_or_case(server, route):
    with server.client() as c:
        for ctype in ("application/json; charset=utf-8", "Application/JSON", "application/json ;x=y"):
            r = c.post(route, content=_raw(BODIES[route]), headers={"content-type": ctype})
            assert r.status_code == 200, r.text
        for ctype in ("text/plain; charset=utf-8", "TEXT/PLAIN", "application/x-www-form-urlencoded; a=b"):
            r = c.post(route, content=_raw(BODIES[route]), headers={"content-type": ctype})
            assert r.status_code == 415, r.text


def test_a_form_post_cannot_flush_the_cache(server):
    """The open tenant on loopback is admin: a page's form POST must not reach the flush."""
    with server.client() as c:
        r = c.post("/admin/cache/flush", content=b"cache_group=x",
                   headers={"content-type": "application/x-www-form-urlencoded"})
        openai_error(r, 415)
        assert c.post("/admin/cache/flush", json={}).status_code == 200


# ---------------------------------------------------------------------- 2. Host
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "x", "a b"])
def test_a_rebinding_host_is_a_421(server, host):
    admitted = server.engine.stats.admitted
    with server.client() as c:
        for method, route in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
            body = BODIES.get(route)
            r = c.request(method, route, json=body, headers={"host": host})
            err = openai_error(r, 421)
            assert err["code"] == "host_not_allowed" and err["type"] == "invalid_request_error"
            assert host in err["message"] and "--allowed-hosts" in err["message"]
        r = c.post("/v1/messages", json=BODIES["/v1/messages"], headers={"host": host})
        assert anthropic_error(r, 421)["type"] == "invalid_request_error"
    assert server.engine.stats.admitted == admitted


def test_local_names_and_addresses_are_accepted_others_not(server):
    port = server.url.rsplit(":", 1)[1]
    with server.client() as c:
        for host in ("localhost", "LOCALHOST:{port}", "localhost.", "127.0.0.1:{port}", "[::1]:{port}",
                     "app.localhost:{port}", "host.docker.internal:{port}", "192.168.1.5"):
            r = c.get("/health", headers={"host": host.format(port=port)})
            assert r.status_code == 200, (host, r.text)
        for host in ("localhost.example", "evil.localhost.example", "127.0.0.1.evil.example", "[::1"):
            assert c.get("/health", headers={"host": host}).status_code == 421, host


def _raw_get(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n" + head + b"\r\n")
        s.settimeout(30)
        return s.recv(4096)


def test_a_request_without_host_is_accepted(server):
    """HTTP/1.0 needs no Host; browsers always send one, so it is no rebinding."""
    assert _raw_get(server.url, b"").startswith(b"HTTP/1.1 200")
    assert _raw_get(server.url, b"Host: evil.example\r\n").startswith(b"HTTP/1.1 421")


def test_allowed_hosts_adds_names_and_star_accepts_any():
    with live_server(model_path("qwen3"), allowed_hosts=["evil.example", "Gateway.LAN:9999"]) as server:
        with server.client() as c:
            assert c.get("/health", headers={"host": "evil.example:1234"}).status_code == 200
            assert c.get("/health", headers={"host": "gateway.lan"}).status_code == 200  # ports are ignored
            r = c.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"], headers={"host": "evil.example"})
            assert r.status_code == 200, r.text
            openai_error(c.get("/health", headers={"host": "other.example"}), 421)
    with live_server(model_path("qwen3"), allowed_hosts=["*"]) as server:
        with server.client() as c:
            assert c.get("/health", headers={"host": "anything.example"}).status_code == 200


def test_host_policy_names():
    assert host_name("[::1]:8080") == "::1" and host_name("Example.COM.:80") == "example.com"
    assert host_name("a b") is None and host_name("[::1") is None and host_name("x:y") is None
    bound = HostPolicy("gateway.lan")
    assert bound.allows("gateway.lan:8080") and not bound.allows("evil.example") and bound.allows(None)
    wildcard = HostPolicy("0.0.0.0")
    own = machine_names()
    assert own and all(wildcard.allows(n) for n in own)
    assert not HostPolicy("127.0.0.1").allows(socket.gethostname() + ".evil.example")


# ---------------------------------------------------------------------- 3. --metrics-key
def test_metrics_key_from_the_flag_over_the_environment(monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_METRICS_KEY", "env-key")
    with live_server(model_path("qwen3"), metrics_key="flag-key") as server, server.client() as c:
        for headers in ({}, {"authorization": "Bearer env-key"}, {"authorization": "Bearer wrong"},
                        {"authorization": "Basic flag-key"}, {"x-api-key": "flag-key"}):
            r = c.get("/metrics", headers=headers)
            err = openai_error(r, 401)
            assert r.headers["www-authenticate"] == "Bearer" and err["type"] == "authentication_error"
        r = c.get("/metrics", headers={"authorization": "Bearer flag-key"})
        assert r.status_code == 200 and "mlx_gateway_requests_total" in r.text
        assert c.get("/health").status_code == 200  # only /metrics is guarded


def test_metrics_key_from_the_environment(monkeypatch, server):
    with server.client() as c:
        assert c.get("/metrics").status_code == 200  # the default stays open
    monkeypatch.setenv("MLX_GATEWAY_METRICS_KEY", "env-key")
    with live_server(model_path("qwen3")) as guarded, guarded.client() as c:
        openai_error(c.get("/metrics"), 401)
        assert c.get("/metrics", headers={"authorization": "bearer env-key"}).status_code == 200


# ---------------------------------------------------------------------- 4. strict types
CHAT = BODIES["/v1/chat/completions"]
STRICT = [
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "32"}, "max_tokens", "an integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": True}, "max_tokens", "an integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.0}, "max_tokens", "an integer"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature", "a number"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "user": 5}, "user", "a string"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "a string or an array"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages.0.content.0.text", "a string"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage",
     "a boolean"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs",
     "a boolean"),
    ("/v1/completions", {**BODIES["/v1/completions"], "prompt": [1, True]}, "prompt.1", "an integer"),
    ("/v1/completions", {**BODIES["/v1/completions"], "seed": "7"}, "seed", "an integer"),
    ("/v1/responses", {**BODIES["/v1/responses"], "max_output_tokens": "32"}, "max_output_tokens", "an integer"),
    ("/v1/responses", {**BODIES["/v1/responses"], "temperature": False}, "temperature", "a number"),
    ("/v1/responses", {**BODIES["/v1/responses"], "store": 1}, "store", "a boolean"),
]


@pytest.mark.parametrize("route,body,param,expected", STRICT, ids=[f"{r}:{p}" for r, _, p, _ in STRICT])
def test_mistyped_fields_are_a_400_naming_the_field_and_type(server, route, body, param, expected):
    admitted = server.engine.stats.admitted
    with server.client() as c:
        err = openai_error(c.post(route, json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert f"expected {expected}" in err["message"], err["message"]
    assert server.engine.stats.admitted == admitted


@pytest.mark.parametrize("field,value,expected", [("stream", "yes", "a boolean"), ("max_tokens", "32", "an integer"),
                                                  ("top_k", 1.5, "an integer"), ("temperature", True, "a number")])
def test_mistyped_messages_fields_are_an_anthropic_400(server, field, value, expected):
    with server.client() as c:
        err = anthropic_error(c.post("/v1/messages", json={**BODIES["/v1/messages"], field: value}), 400)
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{field}: expected {expected}"), err["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_an_integer_is_a_valid_number_a_boolean_is_not(server, route):
    with server.client() as c:
        r = c.post(route, json={**BODIES[route], "temperature": 0, "top_p": 1})
        assert r.status_code == 200, r.text
        r = c.post(route, json={**BODIES[route], "temperature": 0, "top_p": True})
        assert r.status_code == 400, r.text
        assert "expected a number, but got a boolean" in r.text, r.text
