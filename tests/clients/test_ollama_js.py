"""The ``ollama`` npm package (ollama-js), pinned, against the gateway's Ollama API.

The gateway is the one of ``test_ollama.py`` (its ``server`` fixture: a chat model and an
embedding model, in this process). ``ollama_js_drive.mjs`` runs under Node.js and makes
every call through the package (list, show, chat whole and streamed through its async
iterator, generate and its ``context`` round trip, embed, a forced tool call and its
result sent back, ``format``, errors), printing one JSON object of what it read; the
assertions here are on that. The package comes from the npm registry into the agent-CLI
test cache (``tests/agent_cli/install.py``); without npm the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from agent_cli.install import npm_packages

from .common import OFFLINE_ENV, WEATHER, Forecast
from .test_ollama import long_system, server  # noqa: F401  (the same gateway, started per module)

OLLAMA_JS = "ollama@0.6.4"  # the release under test
NODE_MAJOR = 18  # the first Node.js with fetch and web streams, which the package uses
SCRIPT = Path(__file__).with_name("ollama_js_drive.mjs")


@pytest.fixture(scope="module")
def read(server):  # noqa: F811
    """What the script read back from ``server`` through ollama-js (one run per module)."""
    modules, node, why = npm_packages([OLLAMA_JS], NODE_MAJOR)
    if why:  # no npm, the install failed, or no Node.js new enough
        pytest.skip(f"{OLLAMA_JS} is not installed: {why}")
    given = {"host": server.url, "modules": str(modules), "system": long_system("ollama-js"),
             "schema": Forecast.model_json_schema(), "tool": WEATHER}
    r = subprocess.run([node, str(SCRIPT)], input=json.dumps(given), capture_output=True, text=True,
                       timeout=600, env={**os.environ, **OFFLINE_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def assert_stats(r: dict, generated: int) -> None:
    """Counts and durations as Ollama gives them: integers, nanoseconds."""
    assert r["done"] is True and r["done_reason"] in ("stop", "length")
    assert r["eval_count"] == generated and r["prompt_eval_count"] >= 1
    durations = [r[k] for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")]
    assert all(isinstance(d, int) and d >= 0 for d in durations)
    assert 10**5 < r["total_duration"] < 300 * 10**9
    assert r["total_duration"] >= r["prompt_eval_duration"] + r["eval_duration"]
    datetime.fromisoformat(r["created_at"].replace("Z", "+00:00"))


def test_pinned_release(read):
    assert read["version"] == OLLAMA_JS.split("@")[1]


def test_list_and_show(read, server):  # noqa: F811
    assert {"chat", "emb"} <= {m["model"] for m in read["list"]}
    assert {m["model"]: m["family"] for m in read["list"]}["chat"] == "qwen3"
    show = read["show"]
    assert {"completion", "tools"} <= set(show["capabilities"]) and "embedding" not in show["capabilities"]
    assert (show["architecture"], show["family"]) == ("qwen3", "qwen3")
    assert show["context_length"] == server.handle("chat").context_length
    assert read["show_emb"] == ["embedding"]


def test_chat_whole_and_streamed(read):
    whole, streamed = read["chat"], read["chat_stream"]
    assert whole["role"] == "assistant" and whole["done_reason"] == "length" and whole["content"]
    assert_stats(whole, 6)
    assert len(streamed["dones"]) > 1 and streamed["dones"] == [False] * (len(streamed["dones"]) - 1) + [True]
    assert "".join(streamed["contents"]) == whole["content"]
    assert_stats(streamed["last"], 6)


def test_generate_context_round_trip(read):
    first, second = read["generate"]
    assert_stats(first, 5)
    assert_stats(second, 5)
    assert len(first["context"]) - 5 >= first["prompt_eval_count"] > 150
    assert second["context"][:len(first["context"])] == first["context"]
    # the context came back from the prefix cache: only the new turn was evaluated
    assert second["prompt_eval_count"] < 30 < first["prompt_eval_count"]
    streamed = read["generate_stream"]
    assert_stats(streamed["last"], 5)
    assert all(c is None for c in streamed["contexts"][:-1]) and len(streamed["contexts"][-1]) > 5


def test_embed_batch_equals_alone(read):
    emb = read["embed"]
    assert len(emb["batch"]) == 3 and emb["prompt_eval_count"] > 0 and emb["total_duration"] > 0
    assert len({len(v) for v in emb["batch"]}) == 1 and len(emb["batch"][0]) > 8
    np.testing.assert_allclose(emb["batch"], emb["alone"], atol=1e-4)


def test_forced_tool_call_and_its_result(read):
    tools = read["tools"]
    (call,) = tools["calls"]
    assert call["name"] == "get_weather" and isinstance(call["arguments"], dict)
    assert set(call["arguments"]) == {"city"} and isinstance(call["arguments"]["city"], str)
    assert_stats(tools["answered"], 4)


def test_format_json_and_schema(read):
    assert read["format"]["json"].lstrip().startswith("{")  # held to a JSON object from its first token
    assert read["format"]["schema_done_reason"] == "stop"
    Forecast.model_validate_json(read["format"]["schema"])


def test_errors_thrown_as_response_errors(read):
    errors = read["errors"]
    for what in ("chat", "chat_stream", "show"):
        e = errors[what]
        assert (e["thrown"], e["name"], e["status_code"]) == (True, "ResponseError", 404), (what, e)
        assert "no-such-model" in e["error"]
    assert errors["embed_chat_model"]["status_code"] == 400
