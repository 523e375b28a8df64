"""Fuzz the request bodies against the app's own OpenAPI document, over HTTP.

The document is fetched from a live gateway (tiny qwen3, ``max_tokens`` 4, limit 8, so a
request that reaches the engine generates at most 8 tokens). Every generating route is
fuzzed: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``,
``/v1/messages/count_tokens`` and ``/v1/responses``. Bodies come from:

- schemathesis, from the document's request schemas: valid bodies (positive mode) and
  bodies that break the schema (negative mode: wrong types, out-of-range numbers, missing
  fields), for every route;
- a hand-written hypothesis strategy that plants hostile JSON in one to three fields of a
  valid body: huge and negative integers, non-finite and out-of-range floats (``NaN`` and
  ``Infinity`` literals), deeply nested arrays and objects (up to 3000 levels), arbitrary
  unicode (lone surrogates included), negative and out-of-vocabulary token ids (prompts
  and ``logit_bias`` keys), reserved ``chat_template_kwargs``, content blocks and input
  items of every kind (known, unknown and mistyped), tool and output schemas;
- first, a fixed list of requests that once broke the gateway (:func:`known_bad_bodies`).

Every answer must be below 500; a non-2xx answer must carry the route's error body
(Anthropic's on ``/v1/messages``, OpenAI's elsewhere); a 200 stream must end the way its
API ends one (``data: [DONE]``, ``message_stop``, ``response.completed`` or
``response.incomplete``) and hold no error event. Afterwards the engine must
still be alive and normal chat, Messages and Responses requests must succeed. Examples are derandomized (the same
ones on every run) and the run takes about two minutes on a 2-core CPU.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import live_server, model_path

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses")
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}  # per route
HOSTILE_EXAMPLES = 120  # per route
TIMEOUT_S = 30  # per request: a hang fails the test
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ERROR_KEYS = {"message", "type", "param", "code"}
DOCUMENTED = {"200", "400", "401", "403", "404", "408", "413", "415", "421", "429", "431", "503"}
# the last event of a 200 stream, by API (None: OpenAI's ``data: [DONE]``)
STREAM_ENDS = {"/v1/messages": {"message_stop"}, "/v1/responses": {"response.completed", "response.incomplete"}}
ERROR_EVENTS = {"error", "response.failed"}

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
GOOD_CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3"), max_tokens=4, max_tokens_limit=8, max_body_bytes=1 << 20) as s:
        yield s


def check_answer(route: str, status: int, ctype: str, content: bytes, sent: bytes = b"") -> None:
    """Assert the gateway's contract on one answer of ``route`` (to the request body
    ``sent``, named in failure messages).

    Raises:
        AssertionError: a 5xx; a non-2xx without the route's error body (Anthropic's on
        ``/v1/messages``, else OpenAI's); a 200 stream that carries an error event or
        does not end as its API ends one.
    """
    assert status < 500, f"server error {status}: {content[:500]!r} for {sent[:300]!r}"
    if not 200 <= status < 300:
        assert ctype.startswith("application/json"), f"{status} answered as {ctype!r}"
        body = json.loads(content)
        if route.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, content
            err = body["error"]
        else:
            err = body["error"]
            assert set(err) == ERROR_KEYS, content
        assert isinstance(err["message"], str) and err["message"], content
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in content.decode().splitlines() if line.startswith("data: ")]
        ends = STREAM_ENDS.get(route)
        if ends is None:
            assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {content[-300:]!r}"
            for data in events[:-1]:
                assert "error" not in json.loads(data), f"error event in a 200 stream: {data}"
            return
        kinds = [json.loads(data)["type"] for data in events]
        assert kinds and kinds[-1] in ends, f"stream does not end with {ends}: {content[-300:]!r}"
        assert not ERROR_EVENTS.intersection(kinds), f"error event in a 200 stream: {content[-500:]!r}"


# ---------------------------------------------------------------------- hostile values
def _json(value) -> str:
    return json.dumps(value, allow_nan=True)  # NaN / Infinity literals, as Python's json reads them


def _nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "0" + "}" * depth


HUGE_INTS = st.integers(min_value=-(10**400), max_value=10**400) | st.sampled_from(
    [2**31 - 1, 2**31, 2**63, 2**64, -(2**63) - 1, -1, 0])
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)  # NaN, Infinity, 1e308, -0.0, subnormals
UNICODE = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates too
TOKEN_IDS = st.integers(-(2**40), 2**31) | HUGE_INTS
# Any JSON value of the wrong kind, in any slot.
GENERIC = st.one_of(
    HUGE_INTS.map(_json), ANY_FLOAT.map(_json), UNICODE.map(_json),
    st.sampled_from(["null", "true", "[]", "{}", '""', '"0"', '["x"]', '{"x": 1}']),
    st.builds(_nested, st.sampled_from([3, 20, 40, 3000]), st.sampled_from(["array", "object"])),
)
# Values aimed at one field: near-valid values that must still be refused, or handled.
TARGETED = {
    "prompt": st.lists(TOKEN_IDS, min_size=1, max_size=4).map(_json),
    "prompt.0": TOKEN_IDS.map(_json),
    "logit_bias": st.dictionaries(
        TOKEN_IDS.map(str) | st.sampled_from(["abc", "1.5", " 1", "\u0663", ""]),
        st.floats(-100, 100) | ANY_FLOAT, min_size=1, max_size=3).map(_json),
    "messages.0.content": (UNICODE | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_audio"]), "text": UNICODE}), max_size=3)).map(_json),
    "stop": st.lists(UNICODE, max_size=20).map(_json),
    "seed": HUGE_INTS.map(_json),
    "top_k": HUGE_INTS.map(_json),
    "max_tokens": HUGE_INTS.map(_json),
    "temperature": ANY_FLOAT.map(_json),
    "repetition_penalty": ANY_FLOAT.map(_json),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(
        ["tokenize", "return_dict", "add_generation_prompt", "chat_template", "enable_thinking", "x"]),
        st.booleans() | UNICODE, min_size=1, max_size=2).map(_json),
}
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image",
                              "document", "bogus"])},
    optional={"text": UNICODE | HUGE_INTS, "id": UNICODE, "name": UNICODE, "input": st.dictionaries(UNICODE, UNICODE),
              "tool_use_id": UNICODE, "content": UNICODE | st.lists(st.fixed_dictionaries(
                  {"type": st.just("text"), "text": UNICODE})), "is_error": st.booleans() | UNICODE,
              "thinking": UNICODE, "signature": UNICODE, "source": st.just({})})
ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "input_image",
                              "web_search_call", "bogus"])},
    optional={"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
              "content": UNICODE | st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["input_text", "output_text", "input_file", "refusal"]),
                   "text": UNICODE | HUGE_INTS})),
              "call_id": UNICODE, "name": UNICODE, "arguments": UNICODE | st.just('{"a": 1}'),
              "output": UNICODE, "summary": st.lists(st.fixed_dictionaries(
                  {"type": st.just("summary_text"), "text": UNICODE}))})
SCHEMA = st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "array", "bogus", 3])}, optional={
    "properties": st.dictionaries(UNICODE, st.fixed_dictionaries({"type": st.sampled_from(["integer", "x"])})),
    "required": st.lists(UNICODE, max_size=3), "additionalProperties": st.booleans(),
    "maxLength": HUGE_INTS, "pattern": UNICODE})
# Values aimed at the Anthropic and Responses fields.
TARGETED_AGENT = {
    **TARGETED,
    "messages.0.content": (UNICODE | st.lists(BLOCK, max_size=3)).map(_json),
    "system": (UNICODE | st.lists(BLOCK, max_size=2)).map(_json),
    "tools": st.lists(st.fixed_dictionaries(
        {"name": UNICODE | st.sampled_from(["add", "f"]), "input_schema": SCHEMA},
        optional={"type": st.sampled_from(["custom", "function", "web_search_20250305"]),
                  "parameters": SCHEMA}), max_size=3).map(_json),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "function", "x"])},
                                         optional={"name": UNICODE | st.just("add"),
                                                   "disable_parallel_tool_use": st.booleans() | UNICODE}).map(_json),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive", "x"])},
                                      optional={"budget_tokens": HUGE_INTS}).map(_json),
    "output_config": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "x"]), "schema": SCHEMA})}).map(_json),
    "stop_sequences": st.lists(UNICODE, max_size=20).map(_json),
    "max_output_tokens": HUGE_INTS.map(_json),
    "input": (UNICODE | st.lists(ITEM, max_size=4)).map(_json),
    "input.0": ITEM.map(_json),
    "input.0.content": (UNICODE | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": UNICODE}))).map(_json),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
        optional={"name": UNICODE, "schema": SCHEMA, "strict": st.booleans()})}).map(_json),
    "metadata": st.dictionaries(UNICODE, UNICODE | HUGE_INTS, max_size=20).map(_json),
    "previous_response_id": UNICODE.map(_json),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "high", "x"]),
                                                     "summary": UNICODE}).map(_json),
}
CHAT_SLOTS = ["model", "messages", "messages.0.content", "messages.0.role", "max_tokens", "max_completion_tokens",
              "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream", "stream_options", "n",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
              "top_logprobs", "tools", "tool_choice", "chat_template_kwargs", "user", "unknown_field"]
COMPLETION_SLOTS = ["model", "prompt", "prompt.0", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                    "seed", "stream", "n", "repetition_penalty", "logit_bias", "logprobs", "echo", "unknown_field"]
COUNT_SLOTS = ["model", "messages", "messages.0.content", "messages.0.role", "system", "tools", "tool_choice",
               "thinking", "output_config", "output_format", "unknown_field"]
MESSAGES_SLOTS = COUNT_SLOTS + ["max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "min_p",
                                "seed", "metadata", "logit_bias", "repetition_penalty"]
RESPONSES_SLOTS = ["model", "input", "input.0", "input.0.content", "input.0.role", "input.0.type", "instructions",
                   "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens", "temperature", "top_p",
                   "stream", "store", "previous_response_id", "metadata", "reasoning", "background", "user",
                   "unknown_field"]
MSG = [{"role": "user", "content": "hi"}]
BASES = {
    "/v1/chat/completions": ({"model": "test-model", "messages": MSG, "max_tokens": 2}, CHAT_SLOTS, TARGETED),
    "/v1/completions": ({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2}, COMPLETION_SLOTS, TARGETED),
    "/v1/messages": ({"model": "test-model", "messages": MSG, "max_tokens": 2}, MESSAGES_SLOTS, TARGETED_AGENT),
    "/v1/messages/count_tokens": ({"model": "test-model", "messages": MSG}, COUNT_SLOTS, TARGETED_AGENT),
    "/v1/responses": ({"model": "test-model", "input": MSG, "max_output_tokens": 2}, RESPONSES_SLOTS,
                      TARGETED_AGENT),
}


def _planted(slot: str, targeted: dict) -> st.SearchStrategy[tuple[str, str]]:
    values = targeted[slot] | GENERIC if slot in targeted else GENERIC
    return st.tuples(st.just(slot), values)


def hostile_bodies(route: str) -> st.SearchStrategy[bytes]:
    """Raw JSON bodies (bytes): a valid request for ``route`` with one to three slots (a
    field, a message's ``content``/``role``, a prompt token) replaced by hostile JSON text."""
    base, slots, targeted = BASES[route]

    def render(planted: list[tuple[str, str]]) -> bytes:
        body, marks = json.loads(json.dumps(base)), {}
        # deepest slots first: replacing "messages" afterwards just drops their marks
        for i, (slot, raw) in enumerate(sorted(planted, key=lambda p: -p[0].count("."))):
            *parents, last = [int(k) if k.isdigit() else k for k in slot.split(".")]
            target = body
            for key in parents:
                target = target[key]
            target[last] = mark = f"@@{i}@@"
            marks[json.dumps(mark)] = raw
        text = json.dumps(body)
        for mark, raw in marks.items():
            text = text.replace(mark, raw)
        return text.encode()

    planted = st.lists(st.sampled_from(slots).flatmap(lambda slot: _planted(slot, targeted)), min_size=1, max_size=3,
                       unique_by=lambda p: p[0])
    return planted.map(render)


def known_bad_bodies(vocab: int) -> list[tuple[str, bytes]]:
    """Requests that once broke the gateway, for a model of ``vocab`` tokens: (route, raw
    body). Those that crashed the whole process (out-of-bounds writes in MLX) come last, so
    a regression in the others is reported as a failure first."""
    def chat(fields: str) -> tuple[str, bytes]:
        return "/v1/chat/completions", (
            '{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            + fields + "}").encode()

    def comp(fields: str) -> tuple[str, bytes]:
        return "/v1/completions", ('{"model": "test-model", "max_tokens": 2, ' + fields + "}").encode()

    def msgs(fields: str, route: str = "/v1/messages") -> tuple[str, bytes]:
        return route, ('{"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                       + fields + "}").encode()

    def resp(fields: str) -> tuple[str, bytes]:
        return "/v1/responses", ('{"model": "test-model", "max_output_tokens": 2, ' + fields + "}").encode()

    far = vocab + 100_000
    return [
        chat('"logit_bias": {"99999999999": 5}'),  # 500 std::bad_cast
        chat('"logit_bias": {"-5": 5}'),  # silently biased token vocab - 5
        chat('"chat_template_kwargs": {"tokenize": false}'),  # 500 TypeError
        chat('"chat_template_kwargs": {"return_dict": true}'),
        chat('"tools": ' + _nested(3000, "array")),  # 500 RecursionError
        ("/v1/chat/completions", _nested(3000, "object").encode()),
        chat('"repetition_penalty": Infinity'),
        chat('"repetition_penalty": 5e-324, "logprobs": true'),  # 500: NaN logprobs in the JSON answer
        comp('"prompt": [1, 2], "temperature": NaN'),
        comp('"prompt": [-1]'),
        comp(f'"prompt": [{2**63}]'),
        comp('"prompt": [1, 2], "temperature": 1, "seed": -1'),  # 500: mx.random.key takes a uint64
        comp(f'"prompt": [1, 2], "temperature": 1, "seed": {2**64}'),
        comp(f'"prompt": [1, 2], "temperature": 1, "top_k": {2**63}'),  # 500 std::bad_cast
        comp(f'"prompt": [1, 2], "temperature": 1, "top_k": {far}'),  # 500, then every sampled request failed
        chat(f'"logit_bias": {{"{far}": 5}}'),  # crashed the process
        comp(f'"prompt": [1, 2], "logit_bias": {{"{far}": 5}}, "stream": true'),
        chat('"logit_bias": {"2147483647": 5}'),
        chat('"stream": "yes"'),  # once read as true
        chat('"max_tokens": "2"'),  # once read as 2
        msgs(f'"logit_bias": {{"{far}": 5}}, "temperature": 1'),
        msgs(f'"top_k": {2**63}, "temperature": 1'),
        msgs('"seed": -1, "temperature": 1, "stream": true'),
        msgs('"tools": ' + _nested(3000, "array")),
        msgs('"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": 3}}}}]',
             "/v1/messages/count_tokens"),
        msgs('"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", '
             '"content": [{"type": "text", "text": 5}]}]}]', "/v1/messages/count_tokens"),
        resp('"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]'),
        resp('"input": [{"type": "reasoning", "summary": []}], "stream": true'),
        resp('"input": "hi", "previous_response_id": "resp_' + "0" * 48 + '"'),
        resp('"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": ' +
             _nested(40, "object") + "}}"),
        resp('"input": "hi", "max_output_tokens": "2"'),
    ]


# ---------------------------------------------------------------------- tests
def test_openapi_document_is_valid_and_self_contained(server):
    with server.client() as c:
        doc = c.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    text = json.dumps(doc)
    assert "$defs" not in text
    refs = {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs <= set(doc["components"]["schemas"]), refs - set(doc["components"]["schemas"])
    assert doc["components"]["securitySchemes"]["apiKeyHeader"]["name"] == "x-api-key"
    schemas = doc["components"]["schemas"]
    for route in ROUTES:
        responses = doc["paths"][route]["post"]["responses"]
        assert set(responses) == DOCUMENTED
        error = "AnthropicError" if route.startswith("/v1/messages") else "Error"
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + error)
    for name in ("ChatRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest"):
        assert schemas[name]["properties"]["model"]["anyOf"][0] == {"enum": ["test-model"]}
    assert schemas["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 8
    assert {"AnthropicTool", "Tool", "MessageItem", "AnthropicMessage", "Response"} <= set(schemas)


def test_fuzz_request_bodies(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    admitted = server.engine.stats.admitted
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as raw_client:
        for route, body in known_bad_bodies(len(server.tokenizer)):
            r = raw_client.post(route, content=body, headers={"content-type": "application/json"})
            check_answer(route, r.status_code, r.headers.get("content-type", ""), r.content, body)

        for route in ROUTES:
            operation = schema[route]["POST"]
            for mode, n in EXAMPLES.items():

                @settings(FUZZ, max_examples=n)
                @given(case=operation.as_strategy(generation_mode=mode))
                def schema_case(case):
                    note(case.as_curl_command())
                    response = case.call(base_url=server.url, timeout=TIMEOUT_S)
                    case.validate_response(response, checks=CHECKS)
                    ctype = (response.headers.get("content-type") or [""])[0]
                    check_answer(route, response.status_code, ctype, response.content)

                schema_case()

            @settings(FUZZ, max_examples=HOSTILE_EXAMPLES)
            @given(body=hostile_bodies(route))
            def hostile_case(body):
                note(f"{len(body)} bytes: {body[:300]!r}")
                r = raw_client.post(route, content=body, headers={"content-type": "application/json"})
                check_answer(route, r.status_code, r.headers.get("content-type", ""), r.content, body)

            hostile_case()

        assert server.engine.stats.admitted > admitted, "no fuzzed request reached the engine"
        assert server.engine.alive, f"the engine died: {server.engine.error!r}"
        for sampling in ({}, {"temperature": 0.8}, {"temperature": 0.8, "seed": 7}):  # greedy and sampled
            ok = raw_client.post("/v1/chat/completions", json={**GOOD_CHAT, **sampling})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["message"]["role"] == "assistant"
        ok = raw_client.post("/v1/messages", json={"model": "test-model", "messages": MSG, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["type"] == "message", ok.text
        ok = raw_client.post("/v1/responses", json={"model": "test-model", "input": "hi", "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["object"] == "response", ok.text
        assert raw_client.get("/health").json()["status"] == "ok"
