"""Fuzz the request bodies against the app's own OpenAPI document, over HTTP.

The document is fetched from a live gateway (tiny qwen3, ``max_tokens`` 4, limit 8, so a
request that reaches the engine generates at most 8 tokens). Bodies come from:

- schemathesis, from the document's request schemas: valid bodies (positive mode) and
  bodies that break the schema (negative mode: wrong types, out-of-range numbers, missing
  fields), for both POST routes;
- a hand-written hypothesis strategy that plants hostile JSON in one to three fields of a
  valid body: huge and negative integers, non-finite and out-of-range floats (``NaN`` and
  ``Infinity`` literals), deeply nested arrays and objects (up to 3000 levels), arbitrary
  unicode (lone surrogates included), negative and out-of-vocabulary token ids (prompts
  and ``logit_bias`` keys), reserved ``chat_template_kwargs``;
- first, a fixed list of requests that once broke the gateway (:func:`known_bad_bodies`).

Every answer must be below 500; a non-2xx answer must carry OpenAI's error body; a 200
stream must end with ``data: [DONE]`` and hold no error event. Afterwards the engine must
still be alive and a normal chat request must succeed. Examples are derandomized (the same
ones on every run) and the run takes well under a minute on a 2-core CPU.
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

ROUTES = ("/v1/chat/completions", "/v1/completions")
EXAMPLES = {GenerationMode.POSITIVE: 80, GenerationMode.NEGATIVE: 50}  # per route
HOSTILE_EXAMPLES = 150  # per route
TIMEOUT_S = 30  # per request: a hang fails the test
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ERROR_KEYS = {"message", "type", "param", "code"}

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


def check_answer(status: int, ctype: str, content: bytes, sent: bytes = b"") -> None:
    """Assert the gateway's contract on one answer (to the request body ``sent``, named in
    failure messages).

    Raises:
        AssertionError: a 5xx; a non-2xx without OpenAI's error body; a 200 stream that
        carries an error event or does not end with ``data: [DONE]``.
    """
    assert status < 500, f"server error {status}: {content[:500]!r} for {sent[:300]!r}"
    if not 200 <= status < 300:
        assert ctype.startswith("application/json"), f"{status} answered as {ctype!r}"
        err = json.loads(content)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], content
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in content.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"stream does not end with [DONE]: {content[-300:]!r}"
        for data in events[:-1]:
            assert "error" not in json.loads(data), f"error event in a 200 stream: {data}"


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
CHAT_SLOTS = ["model", "messages", "messages.0.content", "messages.0.role", "max_tokens", "max_completion_tokens",
              "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream", "stream_options", "n",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
              "top_logprobs", "tools", "tool_choice", "chat_template_kwargs", "user", "unknown_field"]
COMPLETION_SLOTS = ["model", "prompt", "prompt.0", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                    "seed", "stream", "n", "repetition_penalty", "logit_bias", "logprobs", "echo", "unknown_field"]
BASES = {
    "/v1/chat/completions": ({"model": "test-model", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}, CHAT_SLOTS),
    "/v1/completions": ({"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2}, COMPLETION_SLOTS),
}


def _planted(slot: str) -> st.SearchStrategy[tuple[str, str]]:
    values = TARGETED[slot] | GENERIC if slot in TARGETED else GENERIC
    return st.tuples(st.just(slot), values)


def hostile_bodies(route: str) -> st.SearchStrategy[bytes]:
    """Raw JSON bodies (bytes): a valid request for ``route`` with one to three slots (a
    field, a message's ``content``/``role``, a prompt token) replaced by hostile JSON text."""
    base, slots = BASES[route]

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

    planted = st.lists(st.sampled_from(slots).flatmap(_planted), min_size=1, max_size=3, unique_by=lambda p: p[0])
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
    for route in ROUTES:
        responses = doc["paths"][route]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "403", "404", "408", "413", "429", "431", "503"}
    assert doc["components"]["schemas"]["ChatRequest"]["properties"]["model"]["anyOf"][0] == {"enum": ["test-model"]}


def test_fuzz_request_bodies(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    admitted = server.engine.stats.admitted
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as raw_client:
        for route, body in known_bad_bodies(len(server.state.tokenizer)):
            r = raw_client.post(route, content=body, headers={"content-type": "application/json"})
            check_answer(r.status_code, r.headers.get("content-type", ""), r.content, body)

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
                    check_answer(response.status_code, ctype, response.content)

                schema_case()

            @settings(FUZZ, max_examples=HOSTILE_EXAMPLES)
            @given(body=hostile_bodies(route))
            def hostile_case(body):
                note(f"{len(body)} bytes: {body[:300]!r}")
                r = raw_client.post(route, content=body, headers={"content-type": "application/json"})
                check_answer(r.status_code, r.headers.get("content-type", ""), r.content, body)

            hostile_case()

        assert server.engine.stats.admitted > admitted, "no fuzzed request reached the engine"
        assert server.engine.alive, f"the engine died: {server.engine.error!r}"
        for sampling in ({}, {"temperature": 0.8}, {"temperature": 0.8, "seed": 7}):  # greedy and sampled
            ok = raw_client.post("/v1/chat/completions", json={**GOOD_CHAT, **sampling})
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["message"]["role"] == "assistant"
        assert raw_client.get("/health").json()["status"] == "ok"
