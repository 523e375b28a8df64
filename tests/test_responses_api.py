"""The OpenAI Responses API over real HTTP with the official ``openai`` SDK, on tiny
real models: text and tools, streamed and not, the item history and
``previous_response_id`` chains against the real prefix cache, ``text.format``, the
per-tenant response store, and 400s with their parameter paths."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import live_server, model_path
from gateway.conversation.form import Finished, Piece, ToolCallDelta, Usage
from gateway.protocols.responses import to_turns
from gateway.protocols.responses_events import OutputBuilder
from gateway.protocols.responses_schemas import parse_request
from gateway.protocols.responses_store import ResponseStore
from gateway.protocols.responses_store_memory import MemoryBackend
from gateway.tenancy.tenants import hash_key

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather", "strict": True,
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "ok"], "additionalProperties": False}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=128) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def streamed(client, **body):
    """(events, final response) of a streamed request."""
    events = list(client.responses.create(stream=True, **body))
    assert events[-1].type in TERMINAL
    return events, events[-1].response


def items_of(response) -> list[tuple]:
    """The output items without their random ids."""
    out = []
    for it in response.output:
        if it.type == "function_call":
            out.append((it.type, it.name, it.arguments, it.status))
        elif it.type == "message":
            out.append((it.type, [c.text for c in it.content], it.status))
        else:
            out.append((it.type, it.model_dump(exclude={"id"})))
    return out


def calls_of(response) -> list[tuple[str, dict]]:
    return [(it.name, json.loads(it.arguments)) for it in response.output if it.type == "function_call"]


# ---------------------------------------------------------------------- text
def test_text_streamed_and_not(client):
    body = dict(model="test-model", input="Tell me a story.", temperature=0, max_output_tokens=12)
    r = client.responses.create(**body)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "test-model"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and [it.type for it in r.output] == ["message"]
    msg = r.output[0]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.content[0].annotations == []
    u = r.usage
    assert u.output_tokens == 12 and u.total_tokens == u.input_tokens + 12
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens and u.output_tokens_details.reasoning_tokens == 0

    events, final = streamed(client, **body)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == r.output_text
    assert items_of(final) == items_of(r)
    assert final.usage.input_tokens == u.input_tokens and final.usage.output_tokens == 12


def test_stream_event_order_and_names(server):
    body = {"model": "test-model", "input": "Hi", "temperature": 0, "max_output_tokens": 6, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    events = []
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if lines:
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"]  # the SSE event name is the event's type
            events.append(data)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    item = events[2]["item"]
    assert all(e["item_id"] == item["id"] and e["output_index"] == 0 for e in events[3:-2])
    assert final["output"] == [events[-2]["item"]] and final["output"][0]["id"] == item["id"]


def test_builder_reasoning_then_text_then_calls():
    """Items never interleave, whatever the pieces; reasoning comes out as its own item."""
    b = OutputBuilder()
    evs = b.feed(Piece(reasoning="hmm", tokens=[1])) + b.feed(Piece(reasoning=" ok", tokens=[2]))
    evs += b.feed(Piece(text="Hello"))
    evs += b.feed(Piece(tool_calls=[ToolCallDelta(0, "", "call_1", "add"), ToolCallDelta(0, '{"a":1')]))
    evs += b.feed(Piece(tool_calls=[ToolCallDelta(0, ',"b":2}'), ToolCallDelta(1, "", "call_2", "add"),
                                    ToolCallDelta(1, "{}")]))
    evs += b.finish(Finished("tool_calls", Usage(5, 9, 0)))
    kinds = [e["type"] for e in evs]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    reasoning, message, call1, call2 = b.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm ok"}]
    assert message["content"][0]["text"] == "Hello"
    assert (call1["call_id"], call1["arguments"], call2["arguments"]) == ("call_1", '{"a":1,"b":2}', "{}")
    assert all(it["status"] == "completed" for it in b.items)
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]


# ---------------------------------------------------------------------- tools
CHOICES = ["required", {"type": "function", "name": "add"}, "auto", "none"]


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named", "auto", "none"])
def test_tool_choice_streamed_and_not(client, choice):
    # A forced call needs room to close its arguments; a text answer (auto: a random model
    # does not choose a call) is only compared streamed and not.
    forced = choice == "required" or isinstance(choice, dict)
    body = dict(model="test-model", input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice,
                temperature=0, max_output_tokens=120 if forced else 40, parallel_tool_calls=choice != "required")
    r = client.responses.create(**body)
    calls = calls_of(r)
    if forced:
        # The model thinks first (a reasoning item), then only calls.
        assert r.status == "completed" and calls and not r.output_text
        for it in r.output:
            if it.type != "reasoning":
                assert it.type == "function_call" and it.id.startswith("fc_") and it.call_id.startswith("call_")
        for name, args in calls:
            assert name in SCHEMAS and (isinstance(choice, str) or name == "add")
            jsonschema.validate(args, SCHEMAS[name])
        if isinstance(choice, dict):
            assert len(calls) == 1 and r.tool_choice.name == "add"
    if choice == "none":
        assert not calls
    events, final = streamed(client, **body)
    assert items_of(final) == items_of(r)
    for i, it in enumerate(final.output):
        if it.type == "function_call":
            deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                      and e.output_index == i]
            assert "".join(deltas) == it.arguments


def test_sdk_stream_helper_and_final_response(client):
    with client.responses.stream(model="test-model", input="Add 2 and 3.", tools=[ADD], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_output_tokens=120) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    answer = [it for it in final.output if it.type != "reasoning"]
    assert [it.type for it in answer] == ["function_call"] and final.parallel_tool_calls is False
    jsonschema.validate(json.loads(answer[0].arguments), SCHEMAS["add"])


def test_tool_loop_history_and_previous_response_id_give_the_same_prompts(server, client):
    """The same loop two ways: the whole item history each time, and a chain of
    ``previous_response_id`` with only the new ``function_call_output``."""
    common = dict(model="test-model", instructions="You add numbers with the add tool.", tools=[ADD],
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=40)
    first = [{"type": "message", "role": "user", "content": "What is 2 + 3, then + 4, then + 5?"}]
    history, prev, chained, whole = list(first), None, [], []
    for turn in range(4):
        if prev is None:
            r = client.responses.create(input=first, **common)
        else:
            (call,) = [it for it in prev.output if it.type == "function_call"]
            args = json.loads(call.arguments)
            out = {"type": "function_call_output", "call_id": call.call_id,
                   "output": json.dumps({"sum": args["a"] + args["b"]})}
            history.append(out)
            r = client.responses.create(input=[out], previous_response_id=prev.id, **common)
        assert r.status == "completed" and r.previous_response_id == (prev.id if prev else None)
        server.engine.wait_idle(30)
        w = client.responses.create(input=history, store=False, **common)
        server.engine.wait_idle(30)
        history += [it.to_dict() for it in r.output]
        chained.append(r.usage)
        whole.append(w.usage)
        prev = r
    assert [u.input_tokens for u in chained] == [u.input_tokens for u in whole]
    assert all(a.input_tokens < b.input_tokens for a, b in zip(chained, chained[1:]))
    cached = [u.input_tokens_details.cached_tokens for u in chained]
    assert all(a < b for a, b in zip(cached, cached[1:])), cached
    assert cached[-1] >= chained[-2].input_tokens - 16  # the previous prompt came from the cache
    # The whole-history request came second with the same prompt: (nearly) all of it cached.
    assert all(u.input_tokens_details.cached_tokens >= u.input_tokens - 16 for u in whole[1:])


def test_input_items_list_the_chain_with_stable_ids(client):
    """``GET /v1/responses/{id}/input_items`` through the SDK: the chain's items, then the
    response's own input, OpenAI's shapes, ids kept along the chain, pages that join up."""
    body = dict(model="test-model", temperature=0, max_output_tokens=8)
    r1 = client.responses.create(input="First question.", **body)
    r2 = client.responses.create(input=[{"role": "user", "content": "Second."},
                                        {"role": "assistant", "content": "An answer given before."}],
                                 previous_response_id=r1.id, **body)
    first = list(client.responses.input_items.list(r1.id, order="asc"))
    assert [(it.type, it.role, it.content[0].type, it.content[0].text) for it in first] == [
        ("message", "user", "input_text", "First question.")]
    items = list(client.responses.input_items.list(r2.id, order="asc"))
    assert [it.id for it in items[:1 + len(r1.output)]] == [first[0].id] + [it.id for it in r1.output]
    own = items[1 + len(r1.output):]
    assert [(it.role, it.content[0].type, it.content[0].text, it.status) for it in own] == [
        ("user", "input_text", "Second.", "completed"), ("assistant", "output_text", "An answer given before.",
                                                         "completed")]
    assert len({it.id for it in items}) == len(items) and all(it.id for it in items)
    paged = list(client.responses.input_items.list(r2.id, limit=1))  # default order: newest first
    assert [it.id for it in paged] == [it.id for it in reversed(items)]
    raw = client.responses.input_items.with_raw_response.list(r2.id, limit=2, order="asc").http_response.json()
    assert raw["object"] == "list" and raw["has_more"] is True and raw["first_id"] == items[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_items.list(r2.id, limit=0)
    assert e.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(r2.id, after="msg_unknown")
    # an item id the conversation has already (here: r1's output, sent again) is refused
    again = {"type": "message", "role": "user", "content": "Once more.", "id": first[0].id}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=[again], previous_response_id=r1.id, **body)
    assert e.value.body["param"] == "input" and first[0].id in e.value.body["message"]
    twice = {"type": "message", "role": "user", "content": "Hi.", "id": "msg_twice"}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(input=[twice, twice], **body)
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r1.id)
    assert [it.id for it in client.responses.input_items.list(r2.id, order="asc")] == [it.id for it in items]


def test_reasoning_and_parallel_call_items_are_history(client):
    call = lambda i: {"type": "function_call", "call_id": f"call_{i}", "name": "add", "arguments": '{"a":1,"b":2}'}
    out = lambda i: {"type": "function_call_output", "call_id": f"call_{i}", "output": "3"}
    user = {"role": "user", "content": [{"type": "input_text", "text": "Add twice."}]}
    plain = [user, call(1), call(2), out(1), out(2)]
    thought = [user, {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "I should call add twice."}]}, call(1), call(2), out(1), out(2)]
    _, items = parse_request({"input": thought})
    turns = to_turns(items)
    assert [t.role for t in turns] == ["user", "assistant", "tool", "tool"]
    assert turns[1].reasoning == "I should call add twice." and len(turns[1].tool_calls) == 2
    body = dict(model="test-model", tools=[ADD], temperature=0, max_output_tokens=1, store=False)
    a = client.responses.create(input=plain, **body).usage.input_tokens
    b = client.responses.create(input=thought, **body).usage.input_tokens
    assert b > a  # the reasoning of the turn after the last user message is in the prompt


# ---------------------------------------------------------------------- text.format
def test_json_schema_format(client):
    body = dict(model="test-model", input="A point, please.", temperature=0, max_output_tokens=120,
                text={"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}})
    r = client.responses.create(**body)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), POINT)
    _, final = streamed(client, **body)
    assert final.output_text == r.output_text

    class Point(BaseModel):
        x: int = Field(ge=0, le=9)  # bounded: a random-weight model may write digits until max tokens
        ok: bool

    parsed = client.responses.parse(model="test-model", input="A point.", text_format=Point, temperature=0,
                                    max_output_tokens=120)
    assert isinstance(parsed.output_parsed, Point)


# ---------------------------------------------------------------------- store
def test_store_retrieve_delete(client):
    r = client.responses.create(model="test-model", input="Remember me.", max_output_tokens=3,
                                metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    with httpx.Client(base_url=str(client.base_url)) as c:
        assert c.delete(f"responses/{r.id}").json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="test-model", input="again", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"

    kept = client.responses.create(model="test-model", input="Forget me.", max_output_tokens=3, store=False)
    assert kept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_store_count_bound_over_http(server, client):
    saved, server.app.state.responses = server.app.state.responses, ResponseStore(MemoryBackend(max_responses=2))
    try:
        ids = [client.responses.create(model="test-model", input=f"n{i}", max_output_tokens=1).id
               for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the oldest was evicted
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    finally:
        server.app.state.responses = saved


# ---------------------------------------------------------------------- tenants
KEYS = {"alice": "mgw-test-resp-alice", "bob": "mgw-test-resp-bob"}
TENANTS = "".join(f'[tenants.{n}]\nkey_sha256 = ["{hash_key(k)}"]\n\n' for n, k in KEYS.items())


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    with live_server(model_path("qwen3"), tenants=str(path), max_tokens=4) as s:
        yield s


def test_tenants_cannot_see_each_others_responses(tenant_server):
    sdk = {n: openai.OpenAI(base_url=tenant_server.url + "/v1", api_key=k, max_retries=0, timeout=60)
           for n, k in KEYS.items()}
    r = sdk["alice"].responses.create(model="test-model", input="Alice's secret.", max_output_tokens=2)
    missing = "resp_" + "0" * 48
    bodies = []
    for rid in (r.id, missing):
        with pytest.raises(openai.NotFoundError) as e:
            sdk["bob"].responses.retrieve(rid)
        bodies.append(e.value.body)
        with pytest.raises(openai.NotFoundError):
            sdk["bob"].responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            sdk["bob"].responses.input_items.list(rid)
        with pytest.raises(openai.NotFoundError) as e:
            sdk["bob"].responses.create(model="test-model", input="more", previous_response_id=rid)
        assert e.value.body["param"] == "previous_response_id"
    assert bodies[0] == {**bodies[1], "message": bodies[1]["message"].replace(missing, r.id)}
    with httpx.Client(base_url=tenant_server.url) as c:
        assert c.get(f"/v1/responses/{r.id}").status_code == 401
    assert sdk["alice"].responses.retrieve(r.id).id == r.id  # still there for its owner
    more = sdk["alice"].responses.create(model="test-model", input="more", previous_response_id=r.id,
                                         max_output_tokens=2)
    assert more.usage.input_tokens > r.usage.input_tokens
    bare = sdk["alice"].responses.create(model="test-model", previous_response_id=r.id, max_output_tokens=2)
    assert r.usage.input_tokens < bare.usage.input_tokens < more.usage.input_tokens  # no new input
    sdk["alice"].responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        sdk["alice"].responses.retrieve(r.id)


# ---------------------------------------------------------------------- 400s
BAD = [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add"}]}, "input.0.arguments"),
    ({"input": "hi", "tools": [ADD], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "function": ADD}]}, "tools.0.name"),
    ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice.type"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "lark"}}]},
     "tools.0.format"),
    ({"input": "hi", "tools": [{**ADD, "parameters": {"type": "bogus"}}]}, "tools.0.parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "store": 1}, "store"),
    ({"input": 5}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),  # over the server's limit
    ({"input": []}, "input"),  # nothing to answer
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_400_names_the_parameter(server, body, param):
    with server.client() as c:
        r = c.post("/v1/responses", json={"model": "test-model", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


# ---------------------------------------------------------------------- failures
def test_engine_failure_mid_stream_is_response_failed():
    """The engine breaks after the stream began: the stream ends with ``response.failed``."""
    with live_server(model_path("qwen3")) as server:
        engine = server.engine

        def crash(*a, **k):
            raise SystemExit("simulated crash of the engine thread")

        engine.call(lambda: setattr(engine.core.batch.gen, "next", crash))  # breaks at the next step
        client = server.openai()
        events = list(client.responses.create(model="test-model", input="hi", max_output_tokens=8, stream=True))
        assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
        final = events[-1]
        assert final.type == "response.failed" and final.response.status == "failed"
        assert final.response.error.code == "server_error" and final.response.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(final.response.id)  # failed responses are not stored
