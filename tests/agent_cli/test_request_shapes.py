"""Every request an agent CLI sent in its recorded session (``fixtures/<cli>/*.json``,
written by ``test_agent_sessions.py`` with ``MLX_GATEWAY_RECORD_AGENT_FIXTURES=1``),
replayed as recorded (method, path, query, headers without credentials, body) against a
real gateway serving the tiny qwen3 on Qwen3's tokenizer: each gets a 2xx and an answer
in its protocol's shape (Anthropic Messages events, chat completion chunks, Responses
events, the model list or Codex's model catalog). No CLI runs here.

The fixtures of one CLI replay in their recorded order on one server, so a request
reuses the prefix its predecessors left in the cache, as in the session.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import live_server, model_path

from .recorder import sse_events

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FILES = sorted(FIXTURES.glob("*/*.json"))
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=16) as s:
        yield s


def _replay(server, fx: dict) -> httpx.Response:
    headers = {k: v for k, v in fx["headers"].items() if k.lower() != "content-type"}
    content = None
    if fx["body"] is not None:
        headers["content-type"] = "application/json"
        content = json.dumps(fx["body"]).encode()
    query = f"?{fx['query']}" if fx["query"] else ""
    with server.client(timeout=300) as c:
        return c.request(fx["method"], fx["path"] + query, headers=headers, content=content)


def _check_models(fx: dict, r: httpx.Response) -> None:
    data = r.json()
    if "client_version" in fx["query"]:  # Codex reads its model catalog: {"models": [ModelInfo...]}
        assert isinstance(data.get("models"), list), data
        assert "test-model" in [m.get("slug") for m in data["models"]], data
    else:
        assert data.get("object") == "list" and "test-model" in [m["id"] for m in data["data"]], data


def _check_messages(fx: dict, r: httpx.Response) -> None:
    if not fx["body"].get("stream"):
        data = r.json()
        assert data["type"] == "message" and data["role"] == "assistant", data
        assert isinstance(data["content"], list) and data["stop_reason"] in STOP_REASONS, data
        assert isinstance(data["usage"]["input_tokens"], int) and isinstance(data["usage"]["output_tokens"], int)
        return
    events = [(name, d) for name, d in sse_events(r.text) if name != "ping"]
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert all(isinstance(d, dict) and d.get("type") == name for name, d in events), names
    started = [d["index"] for name, d in events if name == "content_block_start"]
    stopped = [d["index"] for name, d in events if name == "content_block_stop"]
    assert started == stopped == list(range(len(started))), names
    (delta,) = [d for name, d in events if name == "message_delta"]
    assert delta["delta"]["stop_reason"] in STOP_REASONS, delta


def _check_count_tokens(fx: dict, r: httpx.Response) -> None:
    assert isinstance(r.json()["input_tokens"], int), r.text


def _check_chat(fx: dict, r: httpx.Response) -> None:
    if not fx["body"].get("stream"):
        data = r.json()
        assert data["object"] == "chat.completion", data
        choice = data["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in FINISH_REASONS, data
        assert isinstance(data["usage"]["prompt_tokens"], int)
        return
    chunks = [d for _, d in sse_events(r.text)]
    assert chunks and chunks[-1] == "[DONE]", r.text[-300:]
    chunks = chunks[:-1]
    assert all(isinstance(c, dict) and c["object"] == "chat.completion.chunk" for c in chunks), r.text[:300]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert len(finishes) == 1 and finishes[0] in FINISH_REASONS, finishes
    if (fx["body"].get("stream_options") or {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and isinstance(chunks[-1]["usage"]["prompt_tokens"], int), chunks[-1]


def _check_responses(fx: dict, r: httpx.Response) -> None:
    if not fx["body"].get("stream"):
        data = r.json()
        assert data["object"] == "response" and data["status"] in ("completed", "incomplete"), data
        assert isinstance(data["output"], list)
        return
    events = sse_events(r.text)
    types = [d.get("type") for _, d in events if isinstance(d, dict)]
    assert len(types) == len(events) and all(name in (None, t) for (name, _), t in zip(events, types)), types
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"), types
    final = events[-1][1]["response"]
    assert final["status"] in ("completed", "incomplete") and isinstance(final["output"], list), final
    numbers = [d["sequence_number"] for _, d in events if "sequence_number" in d]
    assert numbers == sorted(numbers), numbers


CHECKS = {"/v1/models": _check_models, "/v1/messages": _check_messages, "/v1/messages/count_tokens": _check_count_tokens,
          "/v1/chat/completions": _check_chat, "/v1/responses": _check_responses}


def test_every_cli_has_recorded_fixtures():
    """The shapes below are there to check: each CLI of the matrix left requests."""
    from .clis import CLIS

    assert {p.parent.name for p in FILES} >= set(CLIS), sorted({p.parent.name for p in FILES})


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FILES])
def test_a_recorded_request_is_served_in_its_protocols_shape(server, path):
    fx = json.loads(path.read_text())
    assert fx["path"] in CHECKS, f"no shape check for {fx['path']}"
    r = _replay(server, fx)
    assert 200 <= r.status_code < 300, f"{fx['method']} {fx['path']} -> {r.status_code}: {r.text[:1500]}"
    CHECKS[fx["path"]](fx, r)
