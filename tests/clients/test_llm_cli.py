"""The ``llm`` CLI (Simon Willison's) with the gateway as an OpenAI-compatible model entry.

The ``llm_user_dir`` fixture writes ``extra-openai-models.yaml`` into a fresh user directory
(``LLM_USER_PATH``): ``gw-chat`` speaks Chat Completions, ``gw-responses`` the Responses API,
both with ``supports_schema``. Each test runs the real CLI in a subprocess (no network but
loopback: proxies point at a dead port) and reads back what it logged (``llm logs --json``,
the CLI's own SQLite log).

- Chat Completions, streamed (the CLI's default), a ``--schema`` prompt then a ``-c``
  continuation of the same conversation: stdout is JSON valid for the schema, both turns are
  logged under one conversation id with ``finish_reason: stop`` and usage that sums up, and
  the second prompt is longer than the first prompt and answer together (it holds them).
- Responses, not streamed and streamed: the logged response is a completed ``resp_`` with an
  assistant ``message`` item (after any ``reasoning``), usage that sums up, and the same
  answer both ways.

``llm`` sets ``tool_choice`` to nothing but ``auto``, and a random-weight model does not
choose a call by itself, so no tool loop runs through the CLI (its tools are covered through
the frameworks that share its SDK, tests/clients/test_openai_agents.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema

from .common import OFFLINE_ENV, Report

# Closed: llm sends the schema without "strict", and an open schema lets a random model add
# unbounded properties.
SCHEMA = json.dumps({**Report.model_json_schema(), "additionalProperties": False})


def llm(user_dir: Path, *args: str) -> str:
    """Run ``llm ARGS`` with ``user_dir`` as its user directory; its stdout."""
    script = Path(sys.executable).with_name("llm")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "llm"]
    env = {**os.environ, **OFFLINE_ENV, "LLM_USER_PATH": str(user_dir)}
    done = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"llm {' '.join(args)} exited with {done.returncode}:\n{done.stderr}"
    return done.stdout


def logged(user_dir: Path, n: int) -> list[dict]:
    """The last ``n`` logged responses, oldest first."""
    return json.loads(llm(user_dir, "logs", "--json", "-n", str(n)))


def test_chat_completions_schema_and_a_continued_conversation(llm_user_dir):
    options = ["-o", "temperature", "0", "-o", "max_tokens", "160", "--schema", SCHEMA]
    first = llm(llm_user_dir, "-m", "gw-chat", *options, "Weather in Oslo?")
    jsonschema.validate(json.loads(first), Report.model_json_schema())
    second = llm(llm_user_dir, "-c", *options, "And tomorrow?")
    jsonschema.validate(json.loads(second), Report.model_json_schema())

    a, b = logged(llm_user_dir, 2)
    assert a["model"] == b["model"] == "gw-chat" and a["conversation_id"] == b["conversation_id"]
    assert (a["prompt"], b["prompt"]) == ("Weather in Oslo?", "And tomorrow?")
    assert json.loads(a["response"]) == json.loads(first) and json.loads(b["response"]) == json.loads(second)
    for entry in (a, b):
        usage = entry["response_json"]["usage"]
        assert entry["response_json"]["finish_reason"] == "stop"
        assert entry["response_json"]["id"].startswith("chatcmpl-")
        assert (entry["input_tokens"], entry["output_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert b["input_tokens"] > a["input_tokens"] + a["output_tokens"]


def test_responses_with_and_without_streaming(llm_user_dir):
    options = ["-m", "gw-responses", "-o", "max_tokens", "160", "--schema", SCHEMA, "Weather in Oslo?"]
    whole = llm(llm_user_dir, "--no-stream", *options)
    streamed = llm(llm_user_dir, *options)
    assert json.loads(whole) == json.loads(streamed)
    jsonschema.validate(json.loads(whole), Report.model_json_schema())

    for entry in logged(llm_user_dir, 2):
        response = entry["response_json"]
        assert response["object"] == "response" and response["status"] == "completed"
        assert response["id"].startswith("resp_")
        types = [item["type"] for item in response["output"]]
        assert types[-1] == "message" and set(types[:-1]) <= {"reasoning"}
        assert response["output"][-1]["role"] == "assistant"
        usage = response["usage"]
        assert (entry["input_tokens"], entry["output_tokens"]) == (usage["input_tokens"], usage["output_tokens"])
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
