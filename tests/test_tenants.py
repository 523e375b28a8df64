"""Tenants over real HTTP: keys, model permissions, limits, cache isolation, usage,
admin, CORS and the hardened front door. Every refusal is followed by a request that
still succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_server, model_path, wait_until
from gateway.tenancy.tenants import hash_key

KEYS = {name: f"mgw-test-{name}-key" for name in
        ("alice", "bob", "carol", "dave", "limited", "narrow", "slots", "tpm", "ctpm", "admin")}

TENANTS = f"""
[admin]
key_sha256 = ["{hash_key(KEYS['admin'])}"]

[tenants.alice]
key_sha256 = ["{hash_key(KEYS['alice'])}"]
cache_group = "team"
max_tokens = 64
cache_bytes = "64M"

[tenants.carol]
key_sha256 = ["{hash_key(KEYS['carol'])}"]
cache_group = "team"

[tenants.bob]
key_sha256 = ["{hash_key(KEYS['bob'])}"]
weight = 2.0

[tenants.dave]
key_sha256 = ["{hash_key(KEYS['dave'])}"]

[tenants.limited]
key_sha256 = ["{hash_key(KEYS['limited'])}"]
requests_per_minute = 60

[tenants.narrow]
key_sha256 = ["{hash_key(KEYS['narrow'])}"]
models = ["another-model"]

[tenants.slots]
key_sha256 = ["{hash_key(KEYS['slots'])}"]
max_concurrent = 1

[tenants.tpm]
key_sha256 = ["{hash_key(KEYS['tpm'])}"]
prompt_tokens_per_minute = 120

[tenants.ctpm]
key_sha256 = ["{hash_key(KEYS['ctpm'])}"]
completion_tokens_per_minute = 10
"""

ORIGIN = "chrome-extension://abcdefghijklmnopabcdefghijklmnop"
LONG = " ".join(f"word{i % 17} fact{i % 5}" for i in range(120))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    with live_server(model_path("qwen3"), tenants=str(path), max_tokens=4, allowed_origins=[ORIGIN],
                     client_timeout=1.5, max_prompt_tokens=2000, served_model_names=["another-model"]) as s:
        yield s


def auth(name):
    return {"Authorization": f"Bearer {KEYS[name]}"}


def chat(client, name, content="Hello there", **kw):
    body = {"model": "test-model", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}
    return client.post("/v1/chat/completions", json=body, headers=auth(name) if name else {})


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if code:
        assert err["code"] == code


def assert_ok(client, name="bob"):
    r = chat(client, name)
    assert r.status_code == 200, r.text
    return r


def test_401_for_missing_and_unknown_keys(server):
    with server.client() as c:
        assert_error(chat(c, None), 401, "invalid_api_key")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"Authorization": "Bearer mgw-nobody"})
        assert_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.get("/v1/models"), 401)
        assert_ok(c)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                   headers={"x-api-key": KEYS["bob"]})
        assert r.status_code == 200


def test_404_for_a_model_the_tenant_may_not_use_as_for_an_unknown_one(server):
    with server.client() as c:
        refused = chat(c, "narrow", model="test-model")
        unknown = chat(c, "narrow", model="no-such-model")
        assert_error(refused, 404, "model_not_found")
        assert_error(unknown, 404, "model_not_found")
        assert refused.json()["error"]["message"] == "the model 'test-model' does not exist"
        assert c.get("/v1/models/test-model", headers=auth("narrow")).status_code == 404
        assert chat(c, "narrow", model="another-model").status_code == 200
        ids = [m["id"] for m in c.get("/v1/models", headers=auth("narrow")).json()["data"]]
        assert ids == ["another-model"]


def test_400_for_max_tokens_over_the_tenants_limit(server):
    with server.client() as c:
        r = chat(c, "alice", max_tokens=65)
        assert_error(r, 400)
        assert r.json()["error"]["param"] == "max_tokens"
        assert chat(c, "alice", max_tokens=64).status_code == 200


def test_cache_isolation_between_groups(server):
    prompt = "Isolation check. " + LONG
    with server.client() as c:
        first = chat(c, "alice", prompt)
        assert first.status_code == 200
        assert server.engine.wait_idle(30)
        cached = lambda r: r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        other = chat(c, "dave", prompt)
        same_group = chat(c, "carol", prompt)
    assert other.status_code == same_group.status_code == 200
    assert cached(other) == 0  # dave is in another cache group
    assert cached(same_group) >= first.json()["usage"]["prompt_tokens"] - 8  # carol shares alice's group
    tenants = {r.request_id: r.tenant for r in server.engine.admission_log}
    assert {"alice", "dave", "carol"} <= set(tenants.values())


def test_61_requests_at_60_rpm_get_exactly_one_429(server):
    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=61)) as c:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            return await asyncio.gather(*[
                c.post("/v1/chat/completions", json=body, headers=auth("limited")) for _ in range(61)
            ])

    answers = asyncio.run(burst())
    refused = [r for r in answers if r.status_code == 429]
    assert sorted({r.status_code for r in answers}) == [200, 429]
    assert len(refused) == 1
    r = refused[0]
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 2  # one request refills in 1 s at 60 rpm
    assert r.headers["x-ratelimit-limit-requests"] == "60"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    ok = next(a for a in answers if a.status_code == 200)
    assert ok.headers["x-ratelimit-limit-requests"] == "60"
    with server.client() as c:
        assert_ok(c)  # another tenant is not affected
        # Not a wait on a condition: the client does what a 429 tells it, sleeps Retry-After
        # seconds, and the test asserts that one request after that succeeds (polling
        # instead would send more requests to be refused, and not test the header).
        time.sleep(int(r.headers["retry-after"]))
        assert chat(c, "limited").status_code == 200  # and the limited tenant recovers
    text = server.client().get("/metrics").text
    assert 'mlx_gateway_rate_limited_total{limit="requests",tenant="limited"} 1.0' in text


def test_429_for_too_many_requests_in_flight(server):
    with server.client() as c:
        body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 400,
                "stream": True, "logit_bias": {str(t): -100 for t in server.tokenizer.eos_token_ids}}
        with c.stream("POST", "/v1/chat/completions", json=body, headers=auth("slots")) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # keep the iterator: closing it closes the stream
            next(lines)  # the first request is in flight
            r = chat(c, "slots")
            assert_error(r, 429, "rate_limit_exceeded")
            assert int(r.headers["retry-after"]) >= 1
        assert server.engine.wait_idle(30)
        assert chat(c, "slots").status_code == 200  # the slot is free again


def test_prompt_token_limit(server):
    with server.client() as c:
        r = chat(c, "tpm", "Hello " * 200)
        assert_error(r, 413, "tokens_over_limit")  # could never fit in a minute
        first = chat(c, "tpm", "one two three four five six seven eight nine ten " * 4)
        assert first.status_code == 200
        n = first.json()["usage"]["prompt_tokens"]
        assert 60 < n <= 120
        r = chat(c, "tpm", "one two three four five six seven eight nine ten " * 4)
        assert_error(r, 429, "rate_limit_exceeded")
        assert 1 <= int(r.headers["retry-after"]) <= 61
        assert_ok(c)


def test_completion_token_limit_counts_tokens_as_produced(server):
    bias = {str(t): -100 for t in server.tokenizer.eos_token_ids}
    with server.client() as c:
        first = chat(c, "ctpm", max_tokens=30, logit_bias=bias)
        assert first.status_code == 200
        assert first.json()["usage"]["completion_tokens"] == 30  # over the 10/minute allowance: a debt
        r = chat(c, "ctpm")
        assert_error(r, 429)
        assert int(r.headers["retry-after"]) > 60  # 20 tokens of debt at 10/minute
        assert_ok(c)


def test_usage_and_admin(server):
    with server.client() as c:
        before = c.get("/v1/usage", headers=auth("carol")).json()
        assert before["tenant"] == "carol"
        r = chat(c, "carol", "usage please")
        u = r.json()["usage"]
        after = c.get("/v1/usage", headers=auth("carol")).json()
        for scope in ("total", "window"):
            assert after[scope]["requests"] == before[scope]["requests"] + 1 or scope == "window"
        assert after["total"]["prompt_tokens"] == before["total"]["prompt_tokens"] + u["prompt_tokens"]
        assert after["total"]["completion_tokens"] == before["total"]["completion_tokens"] + u["completion_tokens"]
        assert_error(c.get("/v1/usage"), 401)
        every = c.get("/v1/usage", headers=auth("admin")).json()
        assert {d["tenant"] for d in every["data"]} == {"alice", "bob", "carol", "dave", "limited", "narrow", "slots",
                                                        "tpm", "ctpm"}
        # Admin flush of one cache group.
        prompt = "Flush check. " + LONG
        chat(c, "alice", prompt)
        assert server.engine.wait_idle(30)
        assert_error(c.post("/admin/cache/flush", json={"cache_group": "team"}, headers=auth("alice")), 403)
        assert_error(c.post("/admin/cache/flush", json={"cache_group": "team"}), 401)
        assert_error(c.post("/admin/cache/flush", json={"cache_group": 5}, headers=auth("admin")), 400)
        r = c.post("/admin/cache/flush", json={"cache_group": "team"}, headers=auth("admin"))
        assert r.status_code == 200 and r.json()["dropped_snapshots"] >= 1
        again = chat(c, "carol", prompt)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert_ok(c)
        metrics = c.get("/metrics").text
    quota = [smp.value for fam in text_string_to_metric_families(metrics) for smp in fam.samples
             if smp.name == "mlx_gateway_prompt_cache_quota_bytes"]
    assert quota == [64 << 20]
    assert server.engine.prompt_cache.namespace_bytes("team") <= 64 << 20


def test_cors_allow_list(server):
    with server.client() as c:
        pre = c.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        bad = c.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert bad.status_code == 400
        assert "access-control-allow-origin" not in bad.headers
        r = c.post("/v1/chat/completions", headers={**auth("bob"), "Origin": ORIGIN},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = chat(c, None)  # errors carry CORS headers too, so the extension can read them
        assert r.status_code == 401


def test_hardening_limits(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", headers={**auth("bob"), "x-filler": "a" * 20000},
                   json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code in (400, 431)  # 431 from the gateway, or 400 from the HTTP parser
        if r.status_code == 431:
            assert r.json()["error"]["code"] == "headers_too_large"
        nested: object = 0
        for _ in range(40):
            nested = [nested]
        deep = {"messages": [{"role": "user", "content": "hi"}], "x": nested}
        assert_error(c.post("/v1/chat/completions", json=deep, headers=auth("bob")), 400)
        very_deep = b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        r = c.post("/v1/chat/completions", content=very_deep,
                   headers={**auth("bob"), "content-type": "application/json"})
        assert_error(r, 400)
        assert_error(chat(c, "bob", "word " * 2500), 400, "context_length_exceeded")  # --max-prompt-tokens
        assert_ok(c)
    # A client that stops sending its body gets 408 after --client-timeout.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEYS["bob"].encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mess")
        s.settimeout(10)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head[:100]
    with server.client() as c:
        assert_ok(c)
    assert server.engine.alive


def request_records(caplog, n, timeout=10.0, statuses=()):
    """The request-log records in ``caplog``, waiting for ``n`` of them, and for one of
    each status in ``statuses``: the middleware writes a request's line just after the
    client has its answer (so a line of an earlier test's request can also land here)."""

    def records():
        recs = [r for r in list(caplog.records) if r.name == "mlx_gateway.requests"]
        seen = {getattr(r, "record", {}).get("status") for r in recs}
        return recs if len(recs) >= n and set(statuses) <= seen else None

    return wait_until(records, timeout, f"{n} request-log records (statuses {sorted(statuses)})", interval=0.02)


def test_logs_hold_no_keys_or_prompts_unless_asked(server, caplog):
    secret = "zanzibar-quokka-secret"
    cfg = server.front.config
    with caplog.at_level(logging.DEBUG):
        with server.client() as c:
            assert chat(c, "bob", f"My password is {secret}").status_code == 200
            assert chat(c, None, f"My password is {secret}").status_code == 401
        recs = request_records(caplog, 2, statuses={200, 401})
        assert {r.record.get("status") for r in recs} >= {200, 401}  # the request lines are there...
        text = "\n".join(f"{r.getMessage()} {getattr(r, 'record', '')}" for r in caplog.records)
    assert secret not in text and KEYS["bob"] not in text  # ...without prompt or key, in any log line
    caplog.clear()
    cfg.log_prompts = True
    try:
        with caplog.at_level(logging.INFO):
            with server.client() as c:
                assert chat(c, "bob", f"My password is {secret}").status_code == 200
            records = [r.record for r in request_records(caplog, 1, statuses={200})]
    finally:
        cfg.log_prompts = False
    assert any(secret in (rec.get("prompt") or "") for rec in records)
    assert not any(KEYS["bob"] in str(rec) for rec in records)


def test_single_api_key_mode():
    with live_server(model_path("qwen3"), api_key="mgw-only-key", max_tokens=2) as s, s.client() as c:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert_error(c.post("/v1/chat/completions", json=body), 401)
        ok = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer mgw-only-key"})
        assert ok.status_code == 200
        assert "x-ratelimit-limit-requests" not in ok.headers  # no limits configured, no headers
        r = c.post("/admin/cache/flush", json={}, headers={"Authorization": "Bearer mgw-only-key"})
        assert r.status_code == 200 and r.json()["cache_group"] is None
        assert c.get("/v1/usage", headers={"x-api-key": "mgw-only-key"}).json()["data"][0]["total"]["requests"] == 1


def test_open_mode_on_loopback_needs_no_key():
    with live_server(model_path("qwen3"), max_tokens=2) as s, s.client() as c:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer anything"}).status_code == 200
        assert c.post("/admin/cache/flush").status_code == 200
        assert c.get("/v1/usage").json()["data"][0]["tenant"] == "default"
