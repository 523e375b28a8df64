"""What SGLang's router (sglang-router 0.3.2) adds to the bodies it forwards, and that a
gateway replica understands or ignores all of it (never a 400): the router's requests are
recorded on their way to a real replica (``tests/recording_proxy.py``).

Measured here (and in docs/cluster.md): on ``/v1/responses`` the router adds
``"priority": 0`` (SGLang's integer), ``"stream": null``, ``store``, ``temperature`` and
``top_p`` (1.0 unless given), ``top_k: -1``, ``min_p: 0.0``, ``repetition_penalty: 1.0``, and
drops ``prompt_cache_key`` and ``safety_identifier``; on ``/v1/completions`` it forwards a
client's integer ``priority`` and ``rid`` and adds SGLang's sampling flags; on chat it drops
``priority``, ``rid``, ``user`` and the ``bootstrap_*`` fields, and adds its flags; on
``/v1/embeddings`` it adds nothing and drops ``priority``, ``return_hidden_states`` and the
``bootstrap_*`` fields.
An integer ``priority`` is a latency class: > 0 interactive, 0 the key's class, < 0 batch,
never above the key's class.
"""

from __future__ import annotations

import json

import httpx
import pytest

from cluster_stack import Replica, Router, router_available, wait_for
from conftest import model_path
from gateway.front import request_priority
from gateway.http.errors import APIError
from gateway.tenancy.tenants import Tenant, hash_key
from recording_proxy import RecordingProxy

WHY_NOT = router_available()
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

KEY_STD, KEY_FAST = "mgw-fields-standard-key", "mgw-fields-interactive-key"
TENANTS = f"""
[tenants.std]
key_sha256 = ["{hash_key(KEY_STD)}"]

[tenants.fast]
key_sha256 = ["{hash_key(KEY_FAST)}"]
priority = "interactive"
"""
# What SGLang clients put in a body besides OpenAI's fields (SGLang's request types).
SGLANG = {"rid": "sglang-rid-1", "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 7,
          "return_hidden_states": False, "priority": 3}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fields")
    (tmp / "tenants.toml").write_text(TENANTS)
    replica = Replica(tmp, model_path("qwen3"), "--tenants", str(tmp / "tenants.toml"), "--max-tokens", "8").start()
    proxy = router = None
    try:
        replica.wait_ready()
        proxy = RecordingProxy(replica.url).start()
        router = Router(tmp, [proxy.url]).start()
        router.wait_healthy([proxy.url])
        yield replica, proxy, router
    finally:
        for p in (router, proxy, replica):
            if p is not None:
                p.close()


def send(url: str, key: str, path: str, body: dict) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", path, json=body, headers=headers) as r:
        return r.status_code, r.read().decode()


def forwarded(proxy: RecordingProxy, path: str, marker: str) -> dict:
    """The body the router forwarded for the request whose text holds ``marker``."""
    for seen in proxy.seen:
        if seen.path == path and marker.encode() in seen.body:
            return json.loads(seen.body)
    raise AssertionError(f"the router forwarded no {path} request with {marker!r}")


def classes(replica: Replica, endpoint: str, n: int = 0) -> list[str]:
    """The latency classes of the replica's answered requests on ``endpoint`` (once it has
    logged at least ``n``)."""
    def logged():
        got = [r["priority"] for r in replica.records() if r.get("endpoint") == endpoint and r.get("status") == 200]
        return got if len(got) >= n else None
    return wait_for(logged, 10, f"{n} requests on {endpoint} in the replica's log") if n else logged()


def test_every_route_answers_what_the_router_forwards(stack):
    replica, proxy, router = stack
    model = replica.model
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "chat marker-c1"}], "user": "u1",
                                  "max_tokens": 4, **SGLANG}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "chat marker-c2"}], "max_tokens": 4,
                                  "stream": True, "stream_options": {"include_usage": True}, **SGLANG}),
        ("/v1/completions", {"prompt": "completion marker-p1", "max_tokens": 4, **SGLANG}),
        ("/v1/completions", {"prompt": "completion marker-p2", "max_tokens": 4, "stream": True, **SGLANG}),
        ("/v1/responses", {"input": "responses marker-r1", "instructions": "Be brief.", "max_output_tokens": 4,
                           "prompt_cache_key": "session-1", "safety_identifier": "user-1"}),
        ("/v1/responses", {"input": "responses marker-r2", "max_output_tokens": 4, "temperature": 0, "stream": True}),
    ]
    table = []
    for path, body in cases:
        body = {"model": model, **body}
        status, text = send(router.url, KEY_STD, path, body)
        assert status == 200, (path, text[:400])
        if body.get("stream"):
            ends = ("response.completed", "response.incomplete") if path == "/v1/responses" else ("data: [DONE]",)
            assert any(e in text for e in ends) and "event: error" not in text and '"error": {' not in text, text[-400:]
        marker = next(w for w in json.dumps(body).split() if w.startswith("marker-")).strip('"}]')
        sent = forwarded(proxy, path, marker)
        added = {k: sent[k] for k in sorted(set(sent) - set(body))}
        dropped = sorted(set(body) - set(sent))
        table.append((path, bool(body.get("stream")), added, dropped))
    print()
    for path, stream, added, dropped in table:
        print(f"{path} stream={stream}: added {added}; dropped {dropped}")

    responses = [row for row in table if row[0] == "/v1/responses"]
    for _, stream, added, dropped in responses:
        # the fields behind the old 400s: SGLang's integer priority, and a null stream
        assert added["priority"] == 0 and added["top_k"] == -1
        assert "prompt_cache_key" not in added
    assert responses[0][2]["stream"] is None and set(responses[0][3]) >= {"prompt_cache_key", "safety_identifier"}
    completions = [row for row in table if row[0] == "/v1/completions"]
    assert all("priority" not in dropped and "rid" not in dropped for _, _, _, dropped in completions)
    chats = [row for row in table if row[0] == "/v1/chat/completions"]
    assert all({"priority", "rid", "bootstrap_host"} <= set(dropped) for _, _, _, dropped in chats)
    # the router's priority 0 left each request in its key's class
    assert classes(replica, "responses", 2) == ["standard", "standard"]


def test_embeddings_reach_the_replica_as_sent_but_priority(stack):
    """The router forwards ``/v1/embeddings`` with nothing added, and without ``priority``,
    ``return_hidden_states`` and the ``bootstrap_*`` fields; the replica's own answer comes
    back (a 400 here: its model is not an embedding model)."""
    replica, proxy, router = stack
    body = {"model": replica.model, "input": ["embeddings marker-e1"], "user": "u1", **SGLANG}
    status, text = send(router.url, KEY_STD, "/v1/embeddings", body)
    assert status == 400 and "model_not_embedding" in text, text[:400]
    sent = forwarded(proxy, "/v1/embeddings", "marker-e1")
    dropped = {"priority", "return_hidden_states", "bootstrap_host", "bootstrap_port", "bootstrap_room"}
    assert sent == {k: v for k, v in body.items() if k not in dropped}, sent


def test_an_integer_priority_is_a_latency_class(stack):
    replica, proxy, router = stack
    body = {"model": replica.model, "prompt": "which class", "max_tokens": 2}
    for key, priority, want in [(KEY_STD, 2, "standard"), (KEY_FAST, 2, "interactive"), (KEY_FAST, 0, "interactive"),
                                (KEY_STD, -1, "batch"), (KEY_FAST, -5, "batch")]:
        before = classes(replica, "completions")
        status, text = send(router.url, key, "/v1/completions", {**body, "priority": priority})
        assert status == 200, text
        assert classes(replica, "completions", len(before) + 1)[len(before):] == [want], (key, priority)
    # straight to the replica, on Responses: the client's own integer
    status, text = send(replica.url, KEY_FAST, "/v1/responses",
                        {"model": replica.model, "input": "x", "max_output_tokens": 2, "priority": -2})
    assert status == 200, text
    assert classes(replica, "responses", 3)[-1] == "batch"


def test_priority_values():
    std, fast = Tenant("std"), Tenant("fast", priority="interactive")
    assert request_priority(std, None, {"priority": 0}) == "standard"
    assert request_priority(std, "batch", {"priority": 0}) == "batch"  # 0 asks for nothing: the header decides
    assert request_priority(std, None, {"priority": 7}) == "standard"  # capped at the key's class, no 403
    assert request_priority(fast, None, {"priority": 7}) == "interactive"
    assert request_priority(fast, None, {"priority": -1}) == "batch"
    assert request_priority(fast, None, {"priority": "standard"}) == "standard"
    assert request_priority(std, None, {"priority": None}) == "standard"
    for bad in (True, 1.5, "urgent", [1]):
        with pytest.raises(APIError) as e:
            request_priority(std, None, {"priority": bad})
        assert e.value.status == 400
    with pytest.raises(APIError) as e:
        request_priority(std, None, {"priority": "interactive"})
    assert e.value.status == 403
