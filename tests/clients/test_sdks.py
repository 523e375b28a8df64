"""The official openai and anthropic SDKs, each through one tool loop that uses the helpers
agents build on (the rest of the suite drives their plain calls in depth).

- openai, Chat Completions: turn 1 forces a call and is read three ways, ``create``,
  ``create(stream=True)`` and the ``chat.completions.stream`` helper, which must agree on the
  call; the raw chunks share one id, carry the call at index 0 with its id and name on the
  first delta only, end with ``finish_reason: tool_calls`` and then a usage chunk with no
  choices. Turn 2 sends the tool result to ``chat.completions.parse`` with a pydantic model:
  ``finish_reason: stop``, ``parsed`` an instance, and the prompt is longer than turn 1's.
- openai, Responses: ``responses.create`` forces a ``function_call`` item; turn 2 chains it
  by ``previous_response_id`` with its ``function_call_output`` through the
  ``responses.stream`` helper with ``text_format``: events in order, one sequence, the final
  response completed, parsed, and its usage summing up.
- anthropic: the ``messages.stream`` helper with thinking and a ``cache_control`` breakpoint
  forces ``tool_use`` (thinking block at index 0, the call at 1, ``stop_reason: tool_use``);
  the ``tool_result`` turn is answered by ``messages.create``. Usage: ``input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens`` equals ``count_tokens`` of the same
  request, the breakpoint is written on turn 1 and read back on turn 2.
"""

from __future__ import annotations

import json

import anthropic
import openai

from .common import MODEL, WEATHER, Report


def test_openai_chat_create_stream_helper_and_parse(gateway):
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    body = dict(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=160, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})

    whole = client.chat.completions.create(**body)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert len(json.loads(call.function.arguments)["city"]) <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    *body_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    deltas = [d for c in body_chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert [d.index for d in deltas] == [0] * len(deltas)
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert [d.id for d in deltas[1:]] == [None] * (len(deltas) - 1)
    assert deltas[0].function.name == "get_weather" and all(d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.finish_reason for c in body_chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]

    with client.chat.completions.stream(**body) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.name, e.index, e.arguments) for e in done] == [("get_weather", 0, call.function.arguments)]
    (helper_call,) = final.choices[0].message.tool_calls
    assert (helper_call.function.name, helper_call.function.arguments) == ("get_weather", call.function.arguments)

    messages += [whole.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 degrees"}]
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           response_format=Report, max_tokens=160, temperature=0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert isinstance(choice.message.parsed, Report)
    assert parsed.usage.prompt_tokens > whole.usage.prompt_tokens


def test_openai_responses_create_then_stream_helper(gateway):
    client = openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60)
    tool = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool], max_output_tokens=160,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert first.status == "completed" and first.id.startswith("resp_")
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert {item.type for item in first.output} <= {"reasoning", "function_call"}
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens

    with client.responses.stream(model=MODEL, previous_response_id=first.id, tools=[tool], tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "sunny, 18 degrees"}],
                                 text_format=Report, max_output_tokens=160, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == sorted({e.sequence_number for e in events})
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == list(range(len(final.output)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == text
    assert isinstance(final.output_parsed, Report)
    assert final.usage.input_tokens > first.usage.input_tokens
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_anthropic_stream_thinking_tools_and_cache_usage(gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    system = [{"type": "text", "text": "You answer weather questions with the tool. " * 8,
               "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    body = dict(model=MODEL, system=system, tools=[tool], thinking={"type": "enabled", "budget_tokens": 48},
                max_tokens=200, extra_body={"temperature": 0})

    with client.messages.stream(messages=messages, tool_choice={"type": "tool", "name": "get_weather"},
                                **body) as stream:
        events = [e for e in stream if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]
        first = stream.get_final_message()
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_stop",
                                        "content_block_start", "content_block_stop", "message_delta",
                                        "message_stop"]
    assert [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"] == [
        (0, "thinking"), (1, "tool_use")]
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and len(use.input["city"]) <= 12
    counted = client.messages.count_tokens(model=MODEL, system=system, tools=[tool], messages=messages,
                                           tool_choice={"type": "tool", "name": "get_weather"},
                                           thinking={"type": "enabled", "budget_tokens": 48})
    u1 = first.usage
    assert u1.input_tokens + u1.cache_read_input_tokens + u1.cache_creation_input_tokens == counted.input_tokens
    assert u1.cache_creation_input_tokens > 0

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny, 18 degrees"}]}]
    second = client.messages.create(messages=messages, tool_choice={"type": "none"}, **body)
    assert second.stop_reason in ("end_turn", "max_tokens") and "tool_use" not in [b.type for b in second.content]
    assert second.content[-1].type == "text" and second.id != first.id
    u2 = second.usage
    assert u2.cache_read_input_tokens >= u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    assert u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens > counted.input_tokens
