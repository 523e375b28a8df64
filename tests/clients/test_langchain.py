"""langchain-openai (``ChatOpenAI``, Chat Completions) and langchain-anthropic
(``ChatAnthropic``, Messages) against the gateway.

- ``bind_tools`` with a named ``tool_choice`` and the ``ToolMessage`` loop: one call with a
  provider id (``call_``, ``toolu_``), its result answered by a second turn that calls
  nothing; finish/stop reasons (``tool_calls``/``tool_use``, then not); usage
  (``total = input + output``, for Anthropic ``input`` being ``input_tokens +
  cache_read_input_tokens + cache_creation_input_tokens``), the second prompt the longer.
- ``with_structured_output``: ``json_schema`` (``response_format``, with the tool offered
  but not chosen) for OpenAI; for Anthropic the default ``function_calling`` (a forced tool
  named after the schema) and ``json_schema`` (``output_config.format``).
- ``stream`` of a forced call: tool-call chunks at one index, the aggregate's call equal to
  ``invoke``'s, usage on one chunk (``stream_usage``) equal to ``invoke``'s.
- Anthropic thinking (``thinking`` enabled, the model steered into its think block through
  the gateway's ``logit_bias``) with a JSON-schema answer: a thinking block at index 0, the
  JSON text at index 1, streamed and not, the same both ways. langchain-anthropic drops a
  forced ``tool_choice`` when thinking is on, as Anthropic's API requires, so thinking is
  not combined with a forced call here (tests/clients/test_sdks.py does that).
- A prompt over the context: a 400 ``BadRequestError`` of each SDK with each API's words;
  langchain-anthropic makes it its ``ContextOverflowError``. langchain-openai 1.7.4 would
  too, but it looks for ``context_length_exceeded`` in ``str(error)``, where openai 3.x keeps
  only the message (the code is in ``.code``), so there it stays an ``openai.BadRequestError``
  (its ``OpenAIInvalidRequestError``), as it would from OpenAI itself.
"""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from .common import CONTEXT, MODEL, Forecast, Report, weather_tool


def chat_model(gateway, provider: str, **kw):
    if provider == "openai":
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=MODEL, base_url=gateway.v1, api_key="unused", temperature=0, max_tokens=160,
                          max_retries=0, timeout=60, stream_usage=True, **kw)
    from langchain_anthropic import ChatAnthropic

    # Thinking excludes a temperature (as on Anthropic's API); the server's default is greedy.
    return ChatAnthropic(model=MODEL, base_url=gateway.url, api_key="unused", max_tokens=200, max_retries=0,
                         timeout=60, **({} if "thinking" in kw else {"temperature": 0}), **kw)


def check_usage(message, provider: str) -> None:
    u = message.usage_metadata
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    if provider == "anthropic":
        raw = message.response_metadata["usage"]
        assert u["input_tokens"] == (raw["input_tokens"] + raw["cache_read_input_tokens"]
                                     + raw["cache_creation_input_tokens"])
        assert u["input_token_details"]["cache_read"] == raw["cache_read_input_tokens"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_bind_tools_loop_and_structured_output(gateway, provider):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = chat_model(gateway, provider)
    calls: list[str] = []
    get_weather = tool(weather_tool(calls))
    history = [HumanMessage("Weather in Oslo?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and not ai.invalid_tool_calls
    assert call["id"].startswith({"openai": "call_", "anthropic": "toolu_"}[provider])
    history += [ai, get_weather.invoke(call)]
    assert isinstance(history[-1], ToolMessage) and history[-1].tool_call_id == call["id"]
    assert calls == [call["args"]["city"]] and len(calls[0]) <= 12

    if provider == "openai":
        assert ai.response_metadata["finish_reason"] == "tool_calls"
        # Turn 2: the structured answer, with the tool still offered (tool_choice none).
        out = llm.with_structured_output(Report, include_raw=True, strict=True, tools=[get_weather],
                                         tool_choice="none").invoke(history)
        answer = out["raw"]
        assert answer.response_metadata["finish_reason"] == "stop"
    else:
        assert ai.response_metadata["stop_reason"] == "tool_use"
        # langchain-anthropic has no tool_choice "none": "auto", which a random model answers in text.
        answer = llm.bind_tools([get_weather], tool_choice="auto").invoke(history)
        assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
        out = llm.with_structured_output(Report, include_raw=True).invoke(history)
        assert [c["name"] for c in out["raw"].tool_calls] == ["Report"]
        assert out["raw"].response_metadata["stop_reason"] == "tool_use"
        by_schema = llm.with_structured_output(Forecast, method="json_schema", include_raw=True).invoke(history)
        assert by_schema["parsing_error"] is None and isinstance(by_schema["parsed"], Forecast)
        assert by_schema["raw"].response_metadata["stop_reason"] == "end_turn"
    assert out["parsing_error"] is None and isinstance(out["parsed"], Report)
    assert not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]
    for message in (ai, answer, out["raw"]):
        check_usage(message, provider)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_streams_a_forced_call(gateway, provider):
    from langchain_core.tools import tool

    bound = chat_model(gateway, provider).bind_tools([tool(weather_tool([]))], tool_choice="get_weather")
    whole = bound.invoke("Weather in Oslo?")
    chunks = list(bound.stream("Weather in Oslo?"))
    assert len(chunks) > 3
    indexes = {c["index"] for chunk in chunks for c in chunk.tool_call_chunks}
    assert len(indexes) == 1
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    assert len(merged.tool_calls) == 1 and merged.tool_calls[0]["id"] == merged.tool_call_chunks[0]["id"]
    reason = {"openai": "finish_reason", "anthropic": "stop_reason"}[provider]
    assert merged.response_metadata[reason] == whole.response_metadata[reason] == {
        "openai": "tool_calls", "anthropic": "tool_use"}[provider]
    assert sum(1 for c in chunks if c.usage_metadata) == 1
    assert merged.usage_metadata["output_tokens"] == whole.usage_metadata["output_tokens"]
    assert merged.usage_metadata["input_tokens"] == whole.usage_metadata["input_tokens"]


def test_anthropic_thinking_with_a_json_schema_answer(gateway):
    think = gateway.token_id("<think>")
    llm = chat_model(gateway, "anthropic", thinking={"type": "enabled", "budget_tokens": 48},
                     model_kwargs={"extra_body": {"logit_bias": {str(think): 100}}})
    out = llm.with_structured_output(Forecast, method="json_schema", include_raw=True).invoke("Weather in Oslo?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Forecast)
    raw = out["raw"]
    assert [b["type"] for b in raw.content] == ["thinking", "text"]
    assert raw.response_metadata["stop_reason"] == "end_turn"
    check_usage(raw, "anthropic")

    fmt = {"format": {"type": "json_schema", "schema": Forecast.model_json_schema()}}
    chunks = list(llm.bind(output_config=fmt).stream("Weather in Oslo?"))
    blocks = [(b["index"], b["type"]) for c in chunks if isinstance(c.content, list) for b in c.content]
    assert sorted(set(blocks)) == [(0, "thinking"), (1, "text")]
    assert blocks.index((1, "text")) > max(i for i, b in enumerate(blocks) if b == (0, "thinking"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    thinking = "".join(b["thinking"] for b in merged.content if b["type"] == "thinking")
    text = "".join(b["text"] for b in merged.content if b["type"] == "text")
    assert thinking == raw.content[0]["thinking"]
    assert Forecast.model_validate(json.loads(text)) == out["parsed"]
    assert merged.response_metadata["stop_reason"] == "end_turn"
    assert merged.usage_metadata["output_tokens"] == raw.usage_metadata["output_tokens"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_prompt_over_the_context(gateway, provider):
    from langchain_core.exceptions import ContextOverflowError

    sdk_error = {"openai": openai.BadRequestError, "anthropic": anthropic.BadRequestError}[provider]
    with pytest.raises(sdk_error) as err:
        chat_model(gateway, provider).invoke("word " * (CONTEXT + 100))
    assert err.value.status_code == 400
    if provider == "openai":
        assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
        assert f"This model's maximum context length is {CONTEXT} tokens. However, your messages resulted in" in (
            err.value.message)
    else:
        assert isinstance(err.value, ContextOverflowError)
        m = re.search(rf"prompt is too long: (\d+) tokens > {CONTEXT} maximum", err.value.message)
        assert m and int(m.group(1)) > CONTEXT
