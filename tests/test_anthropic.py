"""Anthropic's Messages API over HTTP with the official ``anthropic`` SDK, on tiny real
models: text, streams and their exact event order, stop reasons, tools in Qwen3's tagged
format and in the system-message fallback (Gemma 3), a tool loop reusing the prefix
cache, structured output, thinking blocks, errors in Anthropic's shape, keys, and
``count_tokens``."""

from __future__ import annotations

import contextlib
import json
import re

import anthropic
import httpx
import jsonschema
import pytest

from conftest import live_server, model_path
from test_structured_output import PERSON, BrokenMatcher

WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
KEY = "k1"

# name -> (model, tokenizer, server config)
# "tagged" has its thinking off: its cases are about tools (tests/test_thinking.py covers calls after thinking).
SERVERS = {"tagged": (("qwen3", "qwen3"), {"chat_template_args": {"enable_thinking": False}}),
           "fallback": (("gemma3_text", "gemma3"), {}),
           "thinking": (("qwen3", None), {"api_key": KEY})}


@pytest.fixture(scope="module")
def servers():
    """Servers started on first use, all stopped at the end of the module."""
    with contextlib.ExitStack() as stack:
        started = {}

        def get(name):
            if name not in started:
                (arch, tok), config = SERVERS[name]
                started[name] = stack.enter_context(live_server(model_path(arch, tok), max_tokens=128, **config))
            return started[name]

        yield get


@pytest.fixture
def server(servers):
    return servers("tagged")


def client(server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **kw)


def events_of(server, body, headers=None) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; SSE comments are checked and dropped."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/messages", json={**body, "stream": True}, headers=headers or {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    out = []
    for chunk in r.text.split("\n\n"):
        lines = [x for x in chunk.split("\n") if x and not x.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
            out.append((lines[0][7:], json.loads(lines[1][6:])))
    assert "[DONE]" not in r.text
    return out


def check_order(events: list[tuple[str, dict]]) -> None:
    """Anthropic's grammar of a successful stream, with block indexes counting from 0."""
    names = [n for n, _ in events]
    shape = " ".join("S" if n == "content_block_start" else "D" if n == "content_block_delta" else
                     "E" if n == "content_block_stop" else n for n in names)
    assert re.fullmatch(r"message_start ping( S( D)* E)* message_delta message_stop", shape), shape
    index = -1
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            index += 1
        if name.startswith("content_block"):
            assert data["index"] == index


def streamed(c: anthropic.Anthropic, **body) -> anthropic.types.Message:
    with c.messages.stream(**body) as s:
        for _ in s:
            pass
        return s.get_final_message()


def blocks(msg) -> list[dict]:
    """Content blocks without ids, for comparing answers."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in msg.content]


# ---------------------------------------------------------------------- 1. text
def test_text_streamed_equals_not_and_stop_reasons(server):
    c = client(server)
    body = dict(model="test-model", max_tokens=12, messages=[{"role": "user", "content": "Tell me a story."}],
                system="You are terse.", extra_body=GREEDY)
    r = c.messages.create(**body)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 12
    s = streamed(c, **body)
    assert s.content[0].text == r.content[0].text and s.stop_reason == "max_tokens"
    assert s.usage.output_tokens == 12
    # A stop sequence taken from the greedy answer cuts it there.
    text = r.content[0].text
    stop = text[len(text) // 2:][:3]
    for answer in (c.messages.create(**body, stop_sequences=[stop]), streamed(c, **body, stop_sequences=[stop])):
        assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
        assert "".join(b.text for b in answer.content) == text[:text.index(stop)]


# ---------------------------------------------------------------------- 2. event order
def test_stream_event_order(server):
    body = {"model": "test-model", "max_tokens": 6, "messages": [{"role": "user", "content": "Hi"}]}
    events = events_of(server, body, headers={"anthropic-version": "2023-06-01"})
    check_order(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6
    assert set(delta["usage"]) >= {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
    # tool_use blocks: input_json_delta only
    # (a thinking model thinks first: thinking and signature deltas, then the call)
    tool = events_of(server, {**body, "max_tokens": 120, "tools": TOOLS, "tool_choice": {"type": "any"}})
    check_order(tool)
    kinds = {d["delta"]["type"] for n, d in tool if n == "content_block_delta"}
    assert "input_json_delta" in kinds and kinds <= {"input_json_delta", "thinking_delta", "signature_delta"}
    assert tool[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_an_engine_error_mid_stream_is_an_error_event(server, monkeypatch):
    import gateway.conversation.prepare as prepare

    real = prepare.output_mask

    def broken(*args):
        mask = real(*args)
        mask.matcher = BrokenMatcher(mask.matcher, fail_at=3)
        return mask

    monkeypatch.setattr(prepare, "output_mask", broken)
    body = {"model": "test-model", "max_tokens": 30, "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}}}
    events = events_of(server, body)
    assert events[-1][0] == "error" and "message_stop" not in [n for n, _ in events]
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as e:
        streamed(client(server), **body)
    assert e.value.body["type"] == "error"
    monkeypatch.undo()
    assert client(server).messages.create(**body).stop_reason == "end_turn"


# ---------------------------------------------------------------------- 3. tools
CHOICES = [{"type": "any"}, {"type": "tool", "name": "add"}, {"type": "auto"}, {"type": "none"}]


@pytest.mark.parametrize("kind", ["tagged", "fallback"])
@pytest.mark.parametrize("choice", CHOICES, ids=["any", "tool", "auto", "none"])
def test_tool_choice_streamed_and_not(servers, kind, choice):
    c = client(servers(kind))
    # A forced call needs room to close its input; a text answer (auto: a random model
    # does not choose a call) is only compared streamed and not.
    calls = choice["type"] in ("any", "tool")
    body = dict(model="test-model", max_tokens=120 if calls else 40, messages=ASK, tools=TOOLS, tool_choice=choice)
    r = c.messages.create(**body)
    uses = [b for b in r.content if b.type == "tool_use"]
    if calls:
        # A thinking model may think first; then only calls.
        answer = [b.type for b in r.content if b.type != "thinking"]
        assert r.stop_reason == "tool_use" and uses and answer == ["tool_use"] * len(uses)
        for b in uses:
            assert b.id.startswith("toolu_") and b.name in SCHEMAS
            jsonschema.validate(b.input, SCHEMAS[b.name])
        if choice["type"] == "tool":
            assert [b.name for b in uses] == ["add"]
    if choice["type"] == "none":
        assert not uses and r.stop_reason in ("end_turn", "max_tokens")
    s = streamed(c, **body)
    assert blocks(s) == blocks(r) and s.stop_reason == r.stop_reason


def test_disable_parallel_tool_use_gives_one_call(server):
    r = client(server).messages.create(model="test-model", max_tokens=60, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use" and len(r.content) == 1


# ---------------------------------------------------------------------- 4. tool loop
@pytest.mark.parametrize("kind", ["tagged", "fallback"])
def test_a_tool_loop_reuses_the_prefix_cache(servers, kind):
    c = client(servers(kind))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Add 2 and 3, then the weather."}]}]
    cached = []
    for turn in range(3):
        r = c.messages.create(model="test-model", max_tokens=60, system=[{"type": "text", "text": "Use tools."}],
                              messages=messages, tools=TOOLS,
                              tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert r.stop_reason == "tool_use"
        cached.append(r.usage.cache_read_input_tokens)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": [{"type": "text", "text": f"r{turn}"}],
                    "is_error": turn == 1} for b in r.content]
        # Text after the results is a user turn of its own: Gemma's template (fallback)
        # refuses two user turns in a row, so only the tagged format gets one.
        text = [{"type": "text", "text": "And now?"}] if kind == "tagged" else []
        messages.append({"role": "user", "content": results + text})
    assert cached[1] > 0 and cached[2] > cached[1], cached
    n = c.messages.count_tokens(model="test-model", system=[{"type": "text", "text": "Use tools."}],
                                messages=messages, tools=TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}).input_tokens
    r = c.messages.create(model="test-model", max_tokens=1, system=[{"type": "text", "text": "Use tools."}],
                          messages=messages, tools=TOOLS,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True})
    u = r.usage
    assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert u.cache_read_input_tokens > cached[2]


# ---------------------------------------------------------------------- 5. structured output
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_output_config_json_schema(server, stream):
    c = client(server)
    for prompt in ("Describe someone.", "x"):
        body = dict(model="test-model", max_tokens=100, messages=[{"role": "user", "content": prompt}],
                    output_config={"format": {"type": "json_schema", "schema": PERSON}})
        r = streamed(c, **body) if stream else c.messages.create(**body)
        assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"]
        jsonschema.validate(json.loads(r.content[0].text), PERSON)


def test_sdk_parse_with_a_pydantic_model(server):
    import pydantic
    from typing import Literal

    class Answer(pydantic.BaseModel):
        kind: Literal["yes", "no"]
        sure: bool

    r = client(server).messages.parse(model="test-model", max_tokens=60, messages=ASK, output_format=Answer)
    assert isinstance(r.parsed_output, Answer) and r.stop_reason == "end_turn"


def test_output_format_of_the_beta_too(server):
    r = client(server).messages.create(model="test-model", max_tokens=100, messages=ASK, extra_body={
        "output_format": {"type": "json_schema", "schema": PERSON}})
    jsonschema.validate(json.loads(r.content[0].text), PERSON)


# ---------------------------------------------------------------------- thinking, keys
def test_thinking_blocks_and_keys(servers):
    server = servers("thinking")
    c = client(server, api_key=KEY)
    think = server.tokenizer.convert_tokens_to_ids("<think>")
    body = dict(model="test-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"logit_bias": {str(think): 100}})
    r = c.messages.create(**body)
    assert [b.type for b in r.content] == ["thinking"] and r.content[0].thinking == "<think>" * 3
    assert r.content[0].signature == ""
    s = streamed(c, **body)
    assert blocks(s) == blocks(r)
    events = events_of(server, {k: v for k, v in body.items() if k != "extra_body"} | body["extra_body"],
                       headers={"x-api-key": KEY})
    check_order(events)
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas == ["thinking_delta"] * (len(deltas) - 1) + ["signature_delta"]
    # Earlier thinking is accepted in history; thinking off pre-fills an empty think block.
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                                 {"type": "text", "text": "hello"}]},
               {"role": "user", "content": "bye"}]
    on = c.messages.count_tokens(model="test-model", messages=history, thinking={"type": "enabled",
                                                                                 "budget_tokens": 2000})
    off = c.messages.count_tokens(model="test-model", messages=history, thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens
    # Keys: x-api-key (the SDK's default), a bearer token, a wrong key.
    bearer = anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="test-model", max_tokens=2, messages=history).content
    for bad in (client(server, api_key="wrong"), client(server, api_key=None, auth_token="wrong")):
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="test-model", max_tokens=2, messages=history)
        assert e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model="test-model", messages=history)


# ---------------------------------------------------------------------- 6. errors
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ({"messages": MSG}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "32"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 5, "stream": "yes"}, "stream"),
    ({"messages": MSG, "max_tokens": 5, "temperature": 1.5}, "temperature"),
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 5}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 5}, "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 5},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "add", "input": {}}]}],
      "max_tokens": 5}, "messages.0.content.0.type"),
    ({"messages": MSG, "max_tokens": 5, "system": [{"type": "text", "text": 3}]}, "system.0.text"),
    ({"messages": MSG, "max_tokens": 5, "tools": [{"name": "add"}]}, "tools.0.input_schema"),
    ({"messages": MSG, "max_tokens": 5, "tools": [{"name": "f", "input_schema": {"type": 3}}]},
     "tools.0.input_schema"),
    ({"messages": MSG, "max_tokens": 5, "tools": [ADD, ADD]}, "tools.1.name"),
    ({"messages": MSG, "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"messages": MSG, "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": MSG, "max_tokens": 5, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": MSG, "max_tokens": 5, "thinking": {"type": "enabled"}}, "thinking"),
    ({"messages": MSG, "max_tokens": 5, "stop_sequences": "x"}, "stop_sequences"),
    ({"messages": MSG, "max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
     "output_config.format.schema"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_request_is_a_400_in_anthropic_shape(server, body, param):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.post("/v1/messages", body={"model": "test-model", **body}, cast_to=anthropic.types.Message)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param + ":"), err


def test_bad_stream_request_is_a_400_before_the_stream(server):
    with pytest.raises(anthropic.BadRequestError):
        streamed(client(server), model="test-model", max_tokens=5, messages=MSG, tools=TOOLS,
                 tool_choice={"type": "tool", "name": "nope"})


def test_unknown_model_is_a_404(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-nope", max_tokens=5, messages=MSG)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="claude-nope", messages=MSG)


# ---------------------------------------------------------------------- 7. count_tokens
def test_count_tokens_equals_the_prompt_of_a_request(server):
    c = client(server)
    body = dict(model="test-model", system="Be brief.", tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
            "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C"}]}])
    prompts = lambda: sum(t.prompt_tokens for t in server.front.usage._total.values())  # noqa: E731
    before = prompts()
    n = c.messages.count_tokens(**body).input_tokens
    assert prompts() == before  # nothing was submitted
    u = c.messages.create(max_tokens=2, **body).usage
    assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert prompts() == before + n  # the tenant's usage books count the request's prompt
    assert c.messages.count_tokens(**{**body, "tools": []}).input_tokens < n
