"""Outcomes tell the truth: for each way a generation ends, its request log line, the
metrics (``/metrics``) and the tenant's usage (``/v1/usage``) agree on how it ended and
on its tokens (real model, real HTTP).

Outcomes: ``stop`` (end of sequence), ``length``, ``stop`` by a stop string, ``tool_calls``,
``cancelled`` (the client left: status 499 in the log), ``error`` (the engine failed it).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from typing import Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_server, model_path, wait_until
from gateway.tenancy.tenants import OPEN_TENANT

TOKENS = ("prompt_tokens", "cached_tokens", "completion_tokens")
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")
LABELS = {"tenant": OPEN_TENANT, "model": "test-model", "api": "chat"}
# Bounded, so that a random-weight model's forced call ends well within max_tokens.
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3"), max_tokens_limit=100_000) as s:
        yield s


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="mlx_gateway.requests")
    return caplog


class Books:
    """The metrics, the usage report and the request log lines at one moment."""

    def __init__(self, server, log):
        with server.client() as c:
            self.metrics = {}
            for family in text_string_to_metric_families(c.get("/metrics").text):
                for s in family.samples:
                    self.metrics[(s.name, tuple(sorted(s.labels.items())))] = s.value
            usage = c.get("/v1/usage").json()
        report = next(u for u in usage["data"] if u["tenant"] == OPEN_TENANT) if "data" in usage else usage
        self.usage = report["total"]
        self.lines = [r.record for r in log.records if r.name == "mlx_gateway.requests"]

    def metric(self, name: str, **labels) -> float:
        """The sum of the samples ``name`` whose labels include ``labels``."""
        return sum(v for (n, ls), v in self.metrics.items() if n == name and labels.items() <= dict(ls).items())


def settle(server, log, before: Books) -> tuple[dict, Books]:
    """Wait for the request's log line and for the engine to be idle; the line and the
    books after."""
    wait_until(lambda: len(Books(server, log).lines) > len(before.lines), 60, "the request log line")
    assert server.engine.wait_idle(60)
    after = Books(server, log)
    return after.lines[len(before.lines)], after


def check_books(line: dict, before: Books, after: Books, reason: str, status: int,
                engine_cancelled: Optional[int] = 0):
    """The log line, the metrics and the usage tell the same story: ``reason``, ``status``
    and the same token counts; the engine counted ``engine_cancelled`` cancellations
    (None: not checked)."""
    assert (line["finish_reason"], line["status"]) == (reason, status), line
    for r in FINISH_REASONS:
        delta = after.metric("mlx_gateway_generations_total", **LABELS, finish_reason=r) \
            - before.metric("mlx_gateway_generations_total", **LABELS, finish_reason=r)
        assert delta == (r == reason), (r, delta, line)
    for field in TOKENS:
        metric = after.metric(f"mlx_gateway_{field}_total", **LABELS) - before.metric(f"mlx_gateway_{field}_total", **LABELS)
        usage = after.usage[field] - before.usage[field]
        assert line[field] == metric == usage, (field, line[field], metric, usage)
    assert after.usage["requests"] - before.usage["requests"] == 1
    cancelled = after.metric("mlx_gateway_requests_cancelled_total") - before.metric("mlx_gateway_requests_cancelled_total")
    assert engine_cancelled is None or cancelled == engine_cancelled, line
    # requests_total counts the outcome's status too (499, or the error's), not the 200 a stream began with.
    counted = {k[1]: after.metrics[k] - before.metrics.get(k, 0.0) for k in after.metrics
               if k[0] == "mlx_gateway_requests_total"}
    statuses = {dict(labels)["status"]: d for labels, d in counted.items() if d}
    assert statuses.get(str(status)) == 1.0, (statuses, line)


def ask(server, stream: bool, **body) -> tuple[str, str]:
    """(content, finish_reason) of one chat request."""
    body = {"messages": [{"role": "user", "content": "Tell me about the sea"}], "temperature": 0,
            "stream": stream, **body}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] or "", choice["finish_reason"]
    content, finish = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                content += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return content, finish


def no_eos(server, bias: float = -100) -> dict:
    return {str(t): bias for t in server.tokenizer.eos_token_ids}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_at_the_end_of_sequence(server, log, stream):
    before = Books(server, log)
    _, finish = ask(server, stream, max_tokens=8, logit_bias=no_eos(server, 100))
    line, after = settle(server, log, before)
    assert finish == "stop"
    check_books(line, before, after, "stop", 200)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ignore_eos_runs_to_max_tokens(server, log, stream):
    """vLLM's ``ignore_eos``: an answer made to pick the end token at every step still
    runs to ``max_tokens``, with no end token in its text."""
    before = Books(server, log)
    text, finish = ask(server, stream, max_tokens=6, logit_bias=no_eos(server, 100), ignore_eos=True)
    line, after = settle(server, log, before)
    assert finish == "length" and line["completion_tokens"] == 6
    assert text == ""  # end tokens are not text
    check_books(line, before, after, "length", 200)


def test_ignore_eos_on_the_other_routes(server):
    """Completions, Responses and Anthropic Messages take ``ignore_eos`` too."""
    bias = no_eos(server, 100)
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "The sea", "max_tokens": 5, "temperature": 0,
                                            "logit_bias": bias, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/responses", json={"input": "The sea", "max_output_tokens": 5, "temperature": 0,
                                          "logit_bias": bias, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 5, r.text
        r = c.post("/v1/messages", json={"messages": [{"role": "user", "content": "The sea"}], "max_tokens": 5,
                                         "temperature": 0, "logit_bias": bias, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
        assert r.json()["usage"]["output_tokens"] == 5


def test_ignore_eos_must_be_a_boolean(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": "yes"})
    assert r.status_code == 400 and "ignore_eos" in r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_length(server, log, stream):
    before = Books(server, log)
    _, finish = ask(server, stream, max_tokens=5, logit_bias=no_eos(server))
    line, after = settle(server, log, before)
    assert finish == "length" and line["completion_tokens"] == 5
    check_books(line, before, after, "length", 200)


def stop_string(server) -> tuple[str, str]:
    """(text, stop): a greedy answer of 16 tokens and a string from the middle of its
    longest run of letters (the random model also writes pieces of UTF-8 sequences)."""
    text, _ = ask(server, False, max_tokens=16, logit_bias=no_eos(server))
    word = max(re.findall(r"[A-Za-z]+", text), key=len, default="")
    assert len(word) >= 4, text
    i = text.index(word) + len(word) // 2 - 1
    return text, text[i:i + 3]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_is_a_stop(server, log, stream):
    text, stop = stop_string(server)
    server.engine.wait_idle(60)
    before = Books(server, log)
    out, finish = ask(server, stream, max_tokens=16, logit_bias=no_eos(server), stop=[stop])
    line, after = settle(server, log, before)
    assert finish == "stop" and stop not in out and text.startswith(out)
    assert line["completion_tokens"] < 16
    check_books(line, before, after, "stop", 200, engine_cancelled=None)  # see the next test


def test_a_stop_string_is_not_counted_as_a_cancellation(server, log):
    """``mlx_gateway_requests_cancelled_total`` counts clients that left, not answers that
    reached a stop string (the engine must be told why a request ends early)."""
    _, stop = stop_string(server)
    server.engine.wait_idle(60)
    before = Books(server, log)
    ask(server, True, max_tokens=16, logit_bias=no_eos(server), stop=[stop])
    line, after = settle(server, log, before)
    check_books(line, before, after, "stop", 200, engine_cancelled=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_calls(server, log, stream):
    before = Books(server, log)
    _, finish = ask(server, stream, max_tokens=60, tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    line, after = settle(server, log, before)
    assert finish == "tool_calls"
    check_books(line, before, after, "tool_calls", 200)


CONTENT = b'"delta": {"content": "'  # a chunk of generated text (not the first, empty one)


def raw_chat(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes) -> bytes:
    """What the server sent, up to and including ``marker``."""
    got = b""
    s.settimeout(60)
    while marker not in got:
        chunk = s.recv(65536)
        assert chunk, got[-500:]
        got += chunk
    return got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_is_cancelled_with_499(server, log, stream):
    before = Books(server, log)
    engine = server.engine
    earlier = set(engine.stats.generated_by_request)
    s = raw_chat(server.url, {"messages": [{"role": "user", "content": "Go on forever"}], "max_tokens": 100_000,
                              "logit_bias": no_eos(server), "stream": stream})
    if stream:
        read_until(s, CONTENT)
    else:
        wait_until(lambda: any(n >= 3 for r, n in list(engine.stats.generated_by_request.items())
                               if r not in earlier), 60, "tokens")
    s.close()
    line, after = settle(server, log, before)
    assert 0 < line["completion_tokens"] < 100_000
    check_books(line, before, after, "cancelled", 499, engine_cancelled=1)


def test_an_engine_failure_is_an_error(log):
    with live_server(model_path("qwen3")) as server:
        before = Books(server, log)
        s = raw_chat(server.url, {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 30000,
                                  "logit_bias": no_eos(server), "stream": True})
        read_until(s, CONTENT)
        stopping = threading.Thread(target=server.engine.stop, kwargs={"reason": "the engine broke"})
        stopping.start()
        got = read_until(s, b"data: [DONE]")
        stopping.join(30)
        s.close()
        assert b"the engine broke" in got
        line, after = settle(server, log, before)
        check_books(line, before, after, "error", 503)


def test_prefill_remaining_tokens_return_to_zero_after_a_cancelled_prefill(log):
    """``mlx_gateway_prefill_remaining_tokens`` counts admitted prompt tokens not yet
    prefilled: a request cancelled while it prefills takes its share with it."""
    with live_server(model_path("qwen3"), prefill_step_size=16, checkpoint_every=100_000) as server:
        before = Books(server, log)
        s = raw_chat(server.url, {"messages": [{"role": "user", "content": "count " * 400}], "max_tokens": 2,
                                  "stream": True})
        got = read_until(s, b": prefill ")  # admitted
        got += read_until(s, b": prefill ")  # and one prefill step done
        s.close()
        line, after = settle(server, log, before)
        assert CONTENT not in got  # still prefilling
        check_books(line, before, after, "cancelled", 499, engine_cancelled=1)
        assert after.metric("mlx_gateway_prefill_remaining_tokens") == 0
