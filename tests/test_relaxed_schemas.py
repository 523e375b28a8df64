"""Schemas that describe rather than promise: a non-strict tool's or format's JSON Schema
may use any keyword (Qwen Code sends ``oneOf``), and is enforced as far as llguidance can;
only ``strict: true`` refuses what cannot be enforced, with a 400 naming it. Through the
official openai SDK against a real gateway (tiny qwen3 on the Qwen3 tokenizer)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import live_server, model_path

# As Qwen Code's edit tool describes its arguments: oneOf, format, pattern, uniqueItems, $ref.
EDIT = {"type": "object", "properties": {
    "path": {"type": "string", "format": "uri-reference", "maxLength": 12},
    "change": {"oneOf": [{"type": "object", "properties": {"old": {"type": "string", "maxLength": 6},
                                                          "new": {"type": "string", "maxLength": 6}},
                          "required": ["old", "new"]},
                         {"type": "object", "properties": {"line": {"$ref": "#/$defs/line"}}, "required": ["line"]}]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "uniqueItems": True,
             "maxItems": 2}},
    "required": ["path", "change"], "$defs": {"line": {"type": "integer", "minimum": 1, "maximum": 99}}}
UNCOMPILABLE = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}


def tool(schema: dict, strict: bool = False, name: str = "edit") -> dict:
    return {"type": "function", "function": {"name": name, "description": "Edit a file.", "parameters": schema,
                                             **({"strict": True} if strict else {})}}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=96) as s:
        yield s


def chat(server, **kw):
    return server.openai().chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Fix the typo."}], temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)


def test_a_non_strict_tool_with_one_of_is_served_under_auto(server):
    r = chat(server, tools=[tool(EDIT)], tool_choice="auto", max_tokens=8)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_a_forced_call_of_a_non_strict_tool_is_valid_json_of_its_shape(server):
    r = chat(server, tools=[tool(EDIT)], tool_choice={"type": "function", "function": {"name": "edit"}})
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    relaxed = {k: v for k, v in EDIT.items()}
    relaxed["properties"] = dict(EDIT["properties"], tags={k: v for k, v in EDIT["properties"]["tags"].items()
                                                           if k != "uniqueItems"})
    jsonschema.validate(args, relaxed)  # everything but uniqueItems (not enforced) holds


def test_a_tool_schema_the_engine_cannot_compile_takes_any_object(server):
    r = chat(server, tools=[tool(UNCOMPILABLE)], tool_choice={"type": "function", "function": {"name": "edit"}},
             max_tokens=48)
    assert r.choices[0].finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize("schema,keyword", [(EDIT, "oneOf"), (EDIT | {"required": ["path"]}, "oneOf"),
                                            (UNCOMPILABLE, "look-around")])
def test_a_strict_tool_that_cannot_be_enforced_is_a_400_naming_it(server, schema, keyword):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, tools=[tool(schema, strict=True)], tool_choice="auto", max_tokens=4)
    assert e.value.body["param"] == "tools.0.function.parameters"
    assert keyword in e.value.body["message"], e.value.body


def test_non_strict_response_format_relaxes_and_strict_refuses(server):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "uniqueItems": True,
              "maxItems": 3}
    r = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
             max_tokens=40)
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value, list) and all(isinstance(x, int) for x in value) and len(value) <= 3
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format={"type": "json_schema",
                                      "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert "uniqueItems" in e.value.body["message"]


def test_an_invalid_schema_is_still_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, tools=[tool({"type": "object", "required": "path"})])
    assert e.value.body["param"] == "tools.0.function.parameters"


def test_models_list_the_context_window_and_capabilities(server):
    with server.client() as c:
        (m,) = c.get("/v1/models").json()["data"]
        assert m["context_length"] == m["max_model_len"] == server.model.context_length
        assert {"chat", "tools", "reasoning"} <= set(m["capabilities"]) and "vision" not in m["capabilities"]
        catalog = c.get("/v1/models", params={"client_version": "0.169.0"}).json()
    (entry,) = catalog["models"]
    assert entry["slug"] == "test-model" and entry["context_window"] == server.model.context_length
    assert entry["model_messages"]["instructions_template"]
    assert [level["effort"] for level in entry["supported_reasoning_levels"]] == ["low", "medium", "high"]
    # The fields Codex 0.169 needs to read an entry (found against its binary).
    assert {"display_name", "experimental_supported_tools", "priority", "shell_type", "support_verbosity",
            "supported_in_api", "supported_reasoning_levels", "truncation_policy", "visibility"} <= set(entry)
