"""Bad input gets an OpenAI-format error with the right status, never reaches the
engine, and a good request right after it still works."""

from __future__ import annotations

import pytest

from conftest import live_server, model_path

GOOD = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3"), max_tokens_limit=64, max_body_bytes=20_000) as s:
        yield s


def _bad(**changes):
    body = dict(GOOD)
    body.update(changes)
    return body


CASES = [
    # (name, how to send, status, param)
    ("malformed json", {"content": b'{"model": "test-model", "messages": ['}, 400, None),
    ("body not an object", {"json": [1, 2]}, 400, None),
    ("messages wrong type", {"json": _bad(messages="hello")}, 400, "messages"),
    ("message role unknown", {"json": _bad(messages=[{"role": "wizard", "content": "x"}])}, 400, "messages.0.role"),
    ("empty messages", {"json": _bad(messages=[])}, 400, "messages"),
    ("temperature wrong type", {"json": _bad(temperature="hot")}, 400, "temperature"),
    ("temperature out of range", {"json": _bad(temperature=7)}, 400, "temperature"),
    ("max_tokens zero", {"json": _bad(max_tokens=0)}, 400, "max_tokens"),
    ("max_tokens over ceiling", {"json": _bad(max_tokens=65)}, 400, "max_tokens"),
    ("n > 1", {"json": _bad(n=3)}, 400, "n"),
    ("image part", {"json": _bad(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])},
     400, None),
    ("unknown model", {"json": _bad(model="gpt-9")}, 404, "model"),
    ("body too large", {"json": _bad(messages=[{"role": "user", "content": "x" * 30_000}])}, 413, None),
]


@pytest.mark.parametrize("name,send,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_chat_request_then_good_one(server, name, send, status, param):
    admitted = server.engine.stats.admitted
    with server.client() as c:
        r = c.post("/v1/chat/completions", headers={"content-type": "application/json"}, **send)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"]
        if param is not None:
            assert err["param"] == param
        assert server.engine.stats.admitted == admitted, "a bad request reached the engine"
        ok = c.post("/v1/chat/completions", json=GOOD)
        assert ok.status_code == 200, ok.text


@pytest.fixture()
def small_context(server):
    old = server.model.context_length
    server.model.context_length = 200
    yield
    server.model.context_length = old


def test_prompt_longer_than_context(server, small_context):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "test-model", "prompt": "word " * 400, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/chat/completions", json=_bad(messages=[{"role": "user", "content": "word " * 400}]))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert c.post("/v1/completions", json={"model": "test-model", "prompt": "word", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_completion_request(server, body, param):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "test-model", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert c.post("/v1/completions", json={"model": "test-model", "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_unknown_route_and_method(server):
    with server.client() as c:
        assert c.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
        assert c.get("/v1/chat/completions").status_code == 405
