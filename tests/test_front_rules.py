"""The cluster front's pure parts (``deploy/cluster/front_rules.py``, ``front_stream.py``):
which requests go around the router, the session and affinity keys, and how a stream lost
mid-answer is ended in each protocol's shape, and the front's own errors in their route's API's
shape (``front.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "cluster"))

from front_rules import affinity_key, around_router, session_key  # noqa: E402
from front_stream import StreamWatch, protocol_of  # noqa: E402


def request(path: str, headers: dict | None = None, method: str = "POST") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": method, "path": path, "headers": raw, "query_string": b""})


def test_session_keys():
    assert session_key("/v1/responses", {"prompt_cache_key": "conv-1", "user": "u"}) == "prompt_cache_key=conv-1"
    assert session_key("/v1/chat/completions", {"safety_identifier": "s", "user": "u"}) == "safety_identifier=s"
    assert session_key("/v1/chat/completions", {"user": "u"}) == "user=u"
    assert session_key("/v1/messages", {"metadata": {"user_id": "ada"}}) == "ada"
    for path, data in [("/v1/chat/completions", {"user": ""}), ("/v1/chat/completions", {"user": 5}),
                       ("/v1/messages", {"user": "u"}), ("/v1/messages", {"metadata": "x"}),
                       ("/v1/models", {"user": "u"})]:
        assert session_key(path, data) is None, (path, data)


def test_affinity_follows_the_session_not_the_conversation():
    one = {"model": "m", "prompt_cache_key": "k", "input": "first"}
    other = {"model": "m", "prompt_cache_key": "k", "input": "another start", "instructions": "x"}
    assert affinity_key("/v1/responses", one) == affinity_key("/v1/responses", other)
    assert affinity_key("/v1/responses", one) != affinity_key("/v1/responses", {**one, "prompt_cache_key": "j"})
    # without a session key: the conversation's start
    a = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    b = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                    {"role": "user", "content": "more"}]}
    assert affinity_key("/v1/messages", a) == affinity_key("/v1/messages", b)


def test_what_goes_around_the_router():
    chat = "/v1/chat/completions"
    body = json.dumps({"model": "m", "messages": []}).encode()
    assert not around_router(request(chat), body)
    assert around_router(request(chat, {"Origin": "https://a.example"}), body)
    assert around_router(request(chat, {"x-priority": "batch"}), body)
    assert around_router(request(chat), json.dumps({"priority": 1, "messages": []}).encode())
    assert around_router(request(chat), json.dumps({"user": "u", "messages": []}).encode())
    assert around_router(request("/v1/completions"), json.dumps({"prompt_cache_key": "k", "prompt": "x"}).encode())
    assert not around_router(request(chat), json.dumps({"messages": [{"role": "user", "content": '"user"'}]}).encode())
    assert not around_router(request(chat), b'{"user": ')  # not JSON: the router answers it


def feed_all(watch: StreamWatch, raw: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(raw), size):
        out += watch.feed(raw[i:i + size])
    return out


def events(raw: bytes) -> list[tuple[str, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name = data = ""
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        out.append((name, data))
    return out


def test_a_whole_stream_passes_unchanged_and_ends():
    raw = (b": prefill 0/9\n\ndata: {\"choices\": [{\"delta\": {\"content\": \"a\"}}]}\n\n"
           b"data: {\"choices\": []}\n\ndata: [DONE]\n\n")
    for size in (1, 7, len(raw)):
        watch = StreamWatch("openai")
        assert feed_all(watch, raw, size) == raw and watch.ended


def test_a_cut_stream_ends_with_its_protocols_error_event():
    # OpenAI: the half event is held back; the error, then [DONE]
    watch = StreamWatch(protocol_of("/v1/chat/completions"))
    out = watch.feed(b"data: {\"choices\": []}\n\ndata: {\"choi")
    assert out == b"data: {\"choices\": []}\n\n" and not watch.ended
    tail = events(watch.failure("lost"))
    assert json.loads(tail[0][1])["error"]["message"] == "lost" and tail[1] == ("", "[DONE]")

    # Anthropic: event: error
    watch = StreamWatch(protocol_of("/v1/messages"))
    watch.feed(b"event: message_start\ndata: {\"type\": \"message_start\"}\n\n")
    (name, data), = events(watch.failure("lost"))
    assert name == "error" and json.loads(data) == {"type": "error", "error": {"type": "api_error", "message": "lost"}}
    ended = StreamWatch("anthropic")
    ended.feed(b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n")
    assert ended.ended

    # Responses: response.failed with the created response, numbered after the last event
    watch = StreamWatch(protocol_of("/v1/responses"))
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    watch.feed(b"event: response.created\ndata: " + json.dumps(
        {"type": "response.created", "sequence_number": 0, "response": created}).encode() + b"\n\n")
    watch.feed(b"event: response.output_text.delta\ndata: {\"type\": \"response.output_text.delta\", "
               b"\"sequence_number\": 4, \"delta\": \"x\"}\n\n")
    (name, data), = events(watch.failure("lost"))
    ev = json.loads(data)
    assert name == "response.failed" and ev["sequence_number"] == 5
    assert ev["response"]["id"] == "resp_1" and ev["response"]["status"] == "failed"
    assert ev["response"]["error"] == {"code": "server_error", "message": "lost"}
    # before response.created: an error event
    (name, data), = events(StreamWatch("responses").failure("lost"))
    assert name == "error" and json.loads(data)["sequence_number"] == 0


def test_the_fronts_own_errors_have_the_shape_of_their_routes_api():
    from front import FrontApp

    def body(path: str, status: int) -> dict:
        r = FrontApp.error(path, status, "no replica", "no_available_replica")
        assert r.status_code == status
        return json.loads(r.body)

    assert body("/v1/chat/completions", 503) == {"error": {
        "message": "no replica", "type": "service_unavailable", "param": None, "code": "no_available_replica"}}
    assert body("/v1/responses/resp_1/input_items", 502)["error"]["type"] == "server_error"
    assert body("/v1/messages", 503) == {"type": "error", "error": {"type": "overloaded_error",
                                                                    "message": "no replica"}}
    assert body("/v1/messages/count_tokens", 502)["error"]["type"] == "api_error"
    assert body("/api/chat", 502) == body("/api/unknown", 502) == {"error": "no replica"}
