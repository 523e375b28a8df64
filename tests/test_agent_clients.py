"""What real agent clients trip on, each driven by the official SDK that trips on it.

- a streamed tool call has one index per chunk, and the openai SDK's stream helper
  (``chat.completions.stream`` then ``get_final_completion``) rebuilds the very call of
  the non-streamed answer;
- a prompt over the context limit answers in the words clients match to compact or
  truncate: OpenAI's ``context_length_exceeded`` message (chat and Responses) and
  Anthropic's ``prompt is too long: N tokens > M maximum``;
- a tool schema that says nothing of ``additionalProperties`` (langchain's ``@tool``,
  pydantic) gets no extra keys;
- Anthropic usage: ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens`` is the prompt, ``cache_creation_input_tokens`` counts
  the tokens up to ``cache_control`` breakpoints, and, on a hybrid (recurrent) model,
  the next turn reads every breakpointed prefix back from the cache;
- Anthropic assistant prefill: a last assistant message is continued, not answered.

Tiny random-weight models (qwen3 with the Qwen3 tokenizer; qwen3_5, a hybrid of
attention and gated delta-net layers), so only protocol facts are checked.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from conftest import live_server, model_path

LIMIT = 160  # --max-prompt-tokens of the servers below
# As langchain's @tool writes it: no additionalProperties.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"]}}}
LONG = "word " * 400


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=96, max_prompt_tokens=LIMIT) as s:
        yield s


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------------- streamed calls
def test_a_streamed_call_has_one_index_per_chunk_and_the_stream_helper_rebuilds_it(server):
    tag = str(server.gateway.models.handles()[0].tokenizer.convert_tokens_to_ids("<tool_call>"))
    client = server.openai()
    body = dict(model="test-model", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                tool_choice="auto", parallel_tool_calls=False, max_tokens=60, temperature=0,
                logit_bias={tag: 100}, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**body)
    assert whole.choices[0].finish_reason == "tool_calls"
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            indexes = [d.index for d in choice.delta.tool_calls or []]
            assert len(indexes) == len(set(indexes)), chunk
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (a,), (b,) = whole.choices[0].message.tool_calls, final.choices[0].message.tool_calls
    assert (a.function.name, a.function.arguments) == (b.function.name, b.function.arguments)
    assert json.loads(b.function.arguments).keys() <= {"city"}


# ---------------------------------------------------------------------- schemas
def test_a_schema_silent_on_additional_properties_gets_no_extra_keys(server):
    r = server.openai().chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "tool_calls"
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(args, {**WEATHER["function"]["parameters"], "additionalProperties": False})


# ---------------------------------------------------------------------- context overflow
def test_context_overflow_in_the_words_openai_clients_match(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().chat.completions.create(model="test-model", messages=[{"role": "user", "content": LONG}])
    err = e.value.body
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith(f"This model's maximum context length is {LIMIT} tokens. However, your "
                                     "messages resulted in "), err
    assert err["message"].endswith("tokens. Please reduce the length of the messages.")
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().responses.create(model="test-model", input=LONG)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is" in e.value.body["message"]


def test_context_overflow_in_the_words_anthropic_clients_match(server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(server).messages.create(model="test-model", max_tokens=4, messages=[{"role": "user", "content": LONG}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error"
    words = err["message"].split()
    assert words[:3] == ["prompt", "is", "too"] and words[5:] == ["tokens", ">", str(LIMIT), "maximum"], err
    assert int(words[4]) > LIMIT


# ---------------------------------------------------------------------- Anthropic usage
def test_anthropic_usage_sums_to_the_prompt_and_counts_breakpoints(server):
    c = claude(server)
    system = [{"type": "text", "text": "You are terse. " * 12, "cache_control": {"type": "ephemeral"}}]
    ask = [{"role": "user", "content": "Hello there."}]
    n = c.messages.count_tokens(model="test-model", system=system, messages=ask).input_tokens
    first = c.messages.create(model="test-model", max_tokens=2, system=system, messages=ask).usage
    assert first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens == n
    assert 0 < first.cache_creation_input_tokens < n and first.input_tokens > 0
    again = c.messages.create(model="test-model", max_tokens=2, system=system,
                              messages=[{"role": "user", "content": "Something else."}]).usage
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
    plain = c.messages.create(model="test-model", max_tokens=2, messages=[{"role": "user", "content": "New."}]).usage
    assert plain.cache_creation_input_tokens == 0


def test_a_breakpoint_on_the_last_user_message_comes_back_on_a_hybrid_model():
    """qwen3_5 keeps recurrent state: without a snapshot at exactly the breakpoint, the
    next turn (a different answer appended) could reuse nothing past the last
    checkpoint that happens to fit."""
    with live_server(model_path("qwen3_5"), max_tokens=16) as s:
        c = claude(s)
        user = {"role": "user", "content": [{"type": "text", "text": "Tell me about " + "boats and seas, " * 10,
                                             "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}
        first = c.messages.create(model="test-model", max_tokens=3, messages=[user])
        mark = first.usage.cache_creation_input_tokens
        assert mark > 0
        s.engine.wait_idle(30)
        turn2 = [user, {"role": "assistant", "content": "Not now."}, {"role": "user", "content": "Why?"}]
        u = c.messages.create(model="test-model", max_tokens=3, messages=turn2).usage
        assert u.cache_read_input_tokens >= mark, (u, mark)


# ---------------------------------------------------------------------- prefill
def test_an_assistant_prefill_is_continued_not_answered(server):
    """The prompt is the template's with the final message continued (Hugging Face's
    ``continue_final_message``), not closed and followed by a new assistant header."""
    c = claude(server)
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    u = c.messages.create(model="test-model", max_tokens=1, messages=msgs).usage
    tok = server.gateway.models.handles()[0].tokenizer
    continued = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=True)
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == len(continued)
    answered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert len(answered) != len(continued)
