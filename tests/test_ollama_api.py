"""Ollama's REST API over raw HTTP: the shapes the clients hide (NDJSON lines, status
codes, ``{"error": ...}`` from the middleware as from the routes), the idioms of its
clients (an empty generate loads or unloads, ``:latest``), the management calls, forced
tool calls (the gateway's ``tool_choice``) read back through the official client's own
response types. (An image through ``/api/chat`` is tested in ``test_vision.py``, on the
vision model served there.)"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import live_server, model_path, wait_until

from gateway.models.spec import ModelSpec
from gateway.tenancy.tenants import hash_key

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    text = model_path("qwen3")
    specs = [ModelSpec(name="chat", path=str(text), pin=True, preload=True),
             ModelSpec(name="spare", path=str(text), keep_alive=None)]
    with live_server(text, specs=specs, max_body_bytes=200_000) as srv:
        yield srv


def lines(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_root_version_and_unknown_paths(server):
    with server.client() as c:
        assert (c.get("/").status_code, c.get("/").text) == (200, "Ollama is running")
        assert c.head("/").status_code == 200
        assert isinstance(c.get("/api/version").json()["version"], str)
        r = c.get("/api/nothing")
        assert r.status_code == 404 and set(r.json()) == {"error"}


def test_chat_streams_ndjson_by_default(server):
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 5, "temperature": 0, "num_ctx": 8192, "mirostat": 2, "num_gpu": 99}}
    with server.client() as c:
        got = lines(c.post("/api/chat", json=body))
        whole = c.post("/api/chat", json={**body, "stream": False}).json()
    *pieces, last = got
    assert all(p["done"] is False and p["message"]["role"] == "assistant" for p in pieces)
    assert last["done"] is True and last["done_reason"] == "length" and last["eval_count"] == 5
    assert "".join(p["message"]["content"] for p in pieces) == whole["message"]["content"]
    for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[k], int) and isinstance(whole[k], int)
    assert whole["total_duration"] >= whole["eval_duration"] > 0
    assert whole["total_duration"] < 600 * 10**9  # nanoseconds of a short request, not seconds or ms


def test_logprobs_read_by_the_official_types(server):
    from ollama._types import ChatResponse

    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
            "options": {"num_predict": 4, "temperature": 0}}
    with server.client() as c:
        whole = ChatResponse.model_validate(c.post("/api/chat", json={**body, "stream": False}).json())
        streamed = lines(c.post("/api/chat", json=body))
    assert len(whole.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in whole.logprobs)
    assert [e["token"] for p in streamed for e in p.get("logprobs", [])] == [lp.token for lp in whole.logprobs]


def test_generate_raw_context_and_refusals(server):
    with server.client() as c:
        r = c.post("/api/generate", json={"model": "chat", "prompt": "Once upon", "raw": True, "stream": False,
                                          "options": {"num_predict": 4}})
        body = r.json()
        assert r.status_code == 200 and body["context"][:len(server.tokenizer.encode("Once upon"))] == \
            list(server.tokenizer.encode("Once upon"))
        assert len(body["context"]) == body["prompt_eval_count"] + body["eval_count"]
        r = c.post("/api/generate", json={"model": "chat", "prompt": "x", "suffix": "y"})
        assert r.status_code == 400 and "insert" in r.json()["error"]
        r = c.post("/api/generate", json={"model": "chat", "prompt": "x", "context": [10**9]})
        assert r.status_code == 400 and "context" in r.json()["error"]
        r = c.post("/api/generate", json={"model": "chat", "prompt": "x", "raw": True, "images": ["aGk="]})
        assert r.status_code == 400 and "images" in r.json()["error"]
        r = c.post("/api/generate", json={"model": "chat", "prompt": "x", "format": "yaml"})
        assert r.status_code == 400 and "format" in r.json()["error"]
        r = c.post("/api/generate", json={"model": "chat", "prompt": "x", "options": {"num_predict": "many"}})
        assert r.status_code == 400 and "num_predict" in r.json()["error"]
        r = c.post("/api/generate", json={"prompt": "x"})
        assert r.status_code == 400 and set(r.json()) == {"error"}


def test_think_reaches_the_template(server):
    """``think: false`` renders Qwen3's closed, empty think block into the prompt; ``true``
    and a level leave the model to open its own; a value that is neither is a 400."""
    def prompt_tokens(**kw) -> int:
        body = c.post("/api/generate", json={"model": "chat", "prompt": "Think?", "stream": False,
                                             "options": {"num_predict": 1}, **kw}).json()
        return len(body["context"]) - body["eval_count"]

    with server.client() as c:
        default, on, level, off = prompt_tokens(), prompt_tokens(think=True), prompt_tokens(think="high"), \
            prompt_tokens(think=False)
        assert default == on == level < off
        assert c.post("/api/generate", json={"model": "chat", "prompt": "x", "think": "hard"}).status_code == 400


def test_form_encoded_body_as_curl_sends_it(server):
    """``curl -d`` declares its body form-encoded: taken from a non-browser client, refused
    (415) from a browser page (an ``Origin``), which could otherwise post it unpreflighted."""
    data = json.dumps({"model": "chat", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    form = {"content-type": "application/x-www-form-urlencoded"}
    with server.client() as c:
        assert c.post("/api/generate", content=data, headers=form).status_code == 200
        r = c.post("/api/generate", content=data, headers={**form, "origin": "https://evil.example"})
        assert r.status_code == 415 and set(r.json()) == {"error"}


def test_middleware_errors_are_ollama_shaped(server):
    with server.client() as c:
        r = c.post("/api/chat", content=b"{" + b" " * 300_000 + b"}", headers={"content-type": "application/json"})
        assert r.status_code == 413 and set(r.json()) == {"error"}
        r = c.post("/api/chat", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()) == {"error"}
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert isinstance(r.json()["error"], dict)  # OpenAI's shape stays on /v1


EVERYWHERE = ['[]', '"x"', '{"model": 5}', '{"source": 1, "model": []}']
BAD_BODIES = {
    "/api/chat": ['{"model": "chat", "messages": "hi"}', '{"model": "chat", "messages": [], "keep_alive": "soon"}', '{"model": "chat", "messages": [{"content": "no role"}]}',
                  '{"model": "chat", "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}',
                  '{"model": "chat", "messages": [{"role": "user", "content": "x"}], "options": []}',
                  '{"model": "chat", "messages": [{"role": "user", "content": "x", "images": [5]}]}'],
    "/api/generate": ['{"model": "chat", "prompt": "x", "context": ["a"]}', '{"model": "chat", "prompt": "x", '
                      '"format": {"type": "object", "properties": 3}}',
                      '{"model": "chat", "prompt": "x", "options": {"stop": [1]}}', '{"model": "chat", "prompt": 5}'],
    "/api/embed": ['{"model": "chat", "input": [1, 2]}', '{"model": "chat", "input": "x", "keep_alive": [1]}', '{"model": "chat", "input": "x", "truncate": "no"}'],
    "/api/embeddings": ['{"model": "chat", "prompt": ["x"]}'],
    "/api/show": ['{}'], "/api/pull": ['{}'], "/api/copy": ['{"source": "chat"}'], "/api/create": ['{}'],
}


def test_bad_bodies_answer_400_everywhere(server):
    with server.client() as c:
        for route, bodies in BAD_BODIES.items():
            for body in EVERYWHERE + bodies:
                r = c.post(route, content=body, headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500, (route, body, r.status_code, r.text)
                assert isinstance(r.json()["error"], str), (route, body, r.text)
        assert c.post("/api/chat", json={"model": "chat", "stream": False, "options": {"num_predict": 1},
                                         "messages": [{"role": "user", "content": "still up?"}]}).status_code == 200


def test_keys_on_api_paths(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.app]\nkey_sha256 = ["{hash_key("sk-app")}"]\nrequests_per_minute = 2\n')
    key = {"authorization": "Bearer sk-app"}
    with live_server(model_path("qwen3"), tenants=str(tenants)) as srv, srv.client() as c:
        r = c.post("/api/chat", json={"model": "test-model", "messages": []})
        assert r.status_code == 401 and set(r.json()) == {"error"}
        assert c.get("/api/tags").status_code == 401
        ok = c.get("/api/tags", headers=key)
        assert [m["name"] for m in ok.json()["models"]] == ["test-model"]
        statuses = [c.post("/api/generate", json={"model": "test-model"}, headers=key) for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429]
        assert set(statuses[-1].json()) == {"error"} and "retry-after" in statuses[-1].headers


def test_forced_tool_call_read_by_the_official_types(server):
    from ollama._types import ChatResponse

    body = {"model": "chat", "stream": False, "tools": [WEATHER], "options": {"num_predict": 60, "temperature": 0},
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    with server.client() as c:
        r = c.post("/api/chat", json=body)
        assert r.status_code == 200, r.text
        msg = ChatResponse.model_validate(r.json()).message
        (call,) = msg.tool_calls
        assert call.function.name == "get_weather" and set(call.function.arguments) == {"city"}
        assert isinstance(r.json()["message"]["tool_calls"][0]["function"]["arguments"], dict)
        streamed = lines(c.post("/api/chat", json={**body, "stream": True}))
        calls = [[t["function"] for t in p["message"]["tool_calls"]] for p in streamed
                 if p["message"].get("tool_calls")]
        assert calls == [[t["function"] for t in r.json()["message"]["tool_calls"]]]
        # the call and its result sent back, as Ollama's clients send them
        history = body["messages"] + [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
        r = c.post("/api/chat", json={**body, "messages": history, "tool_choice": "none"})
        assert r.status_code == 200 and "tool_calls" not in r.json()["message"]


def test_model_routes(server):
    with server.client() as c:
        tags = c.get("/api/tags").json()["models"]
        assert [m["name"] for m in tags] == ["chat", "spare"]
        assert all(m["details"]["family"] == "qwen3" and len(m["digest"]) == 64 for m in tags)
        show = c.post("/api/show", json={"model": "chat:latest"}).json()  # the tag clients add
        assert show["capabilities"][:2] == ["completion", "tools"]
        assert show["model_info"]["general.architecture"] == "qwen3"
        assert show["model_info"]["qwen3.context_length"] == server.model.context_length
        assert c.post("/api/show", json={"model": "nope"}).status_code == 404
        assert c.post("/api/show", json={}).status_code == 400
        ps = c.get("/api/ps").json()["models"]
        assert [m["name"] for m in ps] == ["chat"] and ps[0]["context_length"] == server.model.context_length

        assert c.post("/api/pull", json={"model": "nope"}).status_code == 404
        assert c.post("/api/pull", json={"model": "chat", "stream": False}).json() == {"status": "success"}
        assert lines(c.post("/api/pull", json={"model": "chat"}))[-1] == {"status": "success"}
        assert c.post("/api/copy", json={"source": "chat", "destination": "chat-copy"}).status_code == 200
        assert c.post("/api/copy", json={"source": "chat", "destination": "chat-copy"}).status_code == 400
        assert c.post("/api/copy", json={"source": "nope", "destination": "x"}).status_code == 404
        r = c.post("/api/chat", json={"model": "chat-copy", "stream": False, "messages": [
            {"role": "user", "content": "hi"}], "options": {"num_predict": 1}})
        assert r.status_code == 200 and r.json()["model"] == "chat"
        assert c.post("/api/create", json={"model": "alias2", "from": "chat", "stream": False}).json() == \
            {"status": "success"}
        r = c.post("/api/create", json={"model": "x", "from": "chat", "system": "be brief"})
        assert r.status_code == 400 and "system" in r.json()["error"]
        r = c.request("DELETE", "/api/delete", json={"model": "chat"})
        assert r.status_code == 400 and "deletes no models" in r.json()["error"]
        assert c.request("DELETE", "/api/delete", json={"model": "nope"}).status_code == 404
        assert c.post("/api/push", json={"model": "chat"}).status_code == 400


def test_empty_generate_loads_and_keep_alive_zero_unloads(server):
    def loaded() -> list[str]:
        return [m["name"] for m in c.get("/api/ps").json()["models"]]

    with server.client() as c:
        r = c.post("/api/generate", json={"model": "spare"}).json()
        assert (r["done"], r["done_reason"]) == (True, "load") and "spare" in loaded()
        r = c.post("/api/chat", json={"model": "spare", "messages": [], "keep_alive": 0}).json()
        assert r["done_reason"] == "unload"
        wait_until(lambda: "spare" not in loaded(), 30, "spare to unload")
        r = c.post("/api/generate", json={"model": "spare", "prompt": "hi", "stream": False, "keep_alive": 0,
                                          "options": {"num_predict": 1}})
        assert r.status_code == 200
        assert r.json()["load_duration"] > 10**6  # it waited for the load: over a millisecond, in nanoseconds
        wait_until(lambda: "spare" not in loaded(), 30, "spare to unload after its request")
        assert c.post("/api/generate", json={"model": "spare", "keep_alive": "soon"}).status_code == 400
        assert "chat" in loaded()  # pinned: kept whatever keep_alive asks
