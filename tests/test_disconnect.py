"""A client that leaves cancels its request within one engine step."""

from __future__ import annotations

import socket
import json

from conftest import live_server, model_path, wait_until

MAX = 100_000


def raw_post(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return s


def wait_generating(engine, n_tokens: int = 3) -> str:
    """The id of a request once it has generated ``n_tokens`` tokens."""

    def generating() -> str | None:
        return next((k for k, v in list(engine.stats.generated_by_request.items()) if v >= n_tokens), None)

    return wait_until(generating, 60, f"a request to generate {n_tokens} tokens", interval=0.005)


def test_streaming_and_non_streaming_clients_that_leave_are_cancelled():
    with live_server(model_path("qwen3"), max_tokens_limit=MAX) as server:
        engine = server.engine
        for stream in (True, False):
            engine.stats.generated_by_request.clear()
            cancelled_before = engine.stats.cancelled
            s = raw_post(server.url, {"model": "test-model", "prompt": "hello there", "max_tokens": MAX,
                                      "temperature": 0, "stream": stream})
            rid = wait_generating(engine)
            s.close()
            assert engine.wait_idle(timeout=30), "the engine kept the request running"
            assert engine.stats.cancelled == cancelled_before + 1
            assert engine.stats.generated_by_request[rid] < MAX
            assert engine.num_running == 0
        # and the server still answers
        with server.client() as c:
            r = c.post("/v1/completions", json={"model": "test-model", "prompt": "still there?", "max_tokens": 3})
            assert r.status_code == 200
