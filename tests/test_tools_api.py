"""Tool calls over HTTP with the official openai SDK, on tiny real models: every
``tool_choice``, streamed and not, in each call format (Qwen3's tagged ``<tool_call>``
blocks, Llama 3's JSON, and the system-message fallback of a template without tools)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import live_server, model_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "add"}}, "auto", "none"]

MODELS = {"tagged": ("qwen3", "qwen3"), "json": ("llama", "llama3"), "fallback": ("gemma3_text", "gemma3")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def server(request):
    with live_server(model_path(*MODELS[request.param]), max_tokens=128) as s:
        yield s


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in (message.tool_calls or [])]


def streamed(client, **body):
    """(content, calls, finish_reason) assembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    assert sorted(calls) == list(range(len(calls)))
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named", "auto", "none"])
def test_tool_choice_streamed_and_not(server, choice):
    client = server.openai()
    # A forced call needs room to close its arguments; a text answer (auto: a random model
    # does not choose a call) is only compared streamed and not.
    forced = choice == "required" or isinstance(choice, dict)
    body = dict(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120 if forced else 40)
    if choice == "required":
        # One call: after its think block a random-weight model may call again and again
        # until max_tokens (parallel calls are covered by test_fuzz and the Anthropic tests).
        body["parallel_tool_calls"] = False
    r = client.chat.completions.create(**body)
    message, finish = r.choices[0].message, r.choices[0].finish_reason
    calls = calls_of(message)
    if forced:
        # Constrained: always a call to an offered function with valid arguments.
        assert finish == "tool_calls" and calls and not message.content
        for name, args in calls:
            assert name in SCHEMAS and (isinstance(choice, str) or name == "add")
            jsonschema.validate(args, SCHEMAS[name])
        if isinstance(choice, dict):
            assert len(calls) == 1
    if choice == "none":
        assert not calls and finish in ("stop", "length")
    content, s_calls, s_finish = streamed(client, **body)
    assert (content or None, s_calls, s_finish) == (message.content or None, calls, finish)


def test_a_tool_loop_of_several_turns(server):
    """Call, result, call again: each turn's history (calls and results) renders and is
    reused from the prefix cache."""
    client = server.openai()
    messages = list(MESSAGES)
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model="test-model", messages=messages, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls]})
        for c in m.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": f"result {turn}"})
    assert cached[1] > 0 and cached[2] > cached[1]


def test_parallel_tool_calls_false_gives_one_call(server):
    r = server.openai().chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assert len(r.choices[0].message.tool_calls) == 1


BAD = [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": "get_weather"}, "tools"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_get_a_400_naming_the_parameter(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=4, **body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert server.engine.alive and server.engine.stats.failed == 0
