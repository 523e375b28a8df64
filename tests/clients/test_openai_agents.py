"""openai-agents: a ``Runner`` with a ``function_tool`` and a pydantic ``output_type``, over
Chat Completions (``OpenAIChatCompletionsModel``, ``Runner.run``) and over Responses
(``OpenAIResponsesModel``, ``Runner.run_streamed``).

The agent forces a tool call (``tool_choice="required"``); the SDK's ``reset_tool_choice``
turns it back to ``auto`` once the tool ran, and the second model turn answers with the
structured output (the gateway constrains it to the schema, so it finishes). Checked: the
tool ran once with schema-valid arguments, the call item's ``call_id`` is its output item's,
the run took two model requests, the second prompt is the longer (it holds the call and its
result), the run's usage is the sum of the requests', and the streamed run's raw events are
Responses events, one ``response.created`` to one ``response.completed`` per request, with
the call's arguments and the answer streamed as deltas. Tracing is off (it would export to
api.openai.com).
"""

from __future__ import annotations

import json

import openai
import pytest

from .common import MODEL, Report, weather_tool


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_runner_with_a_function_tool(gateway, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    calls: list[str] = []
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60) as client:
        model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        agent = Agent(name="weather", instructions="Answer with the weather tool.",
                      model=model_class(model=MODEL, openai_client=client),
                      tools=[function_tool(weather_tool(calls))], output_type=Report,
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=160))
        if api == "chat":
            result = await Runner.run(agent, "Weather in Oslo?", max_turns=4)
        else:
            result = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
            raw = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
            assert raw.count("response.created") == raw.count("response.completed") == 2
            assert raw[0] == "response.created" and raw[-1] == "response.completed"
            assert "response.function_call_arguments.delta" in raw and "response.output_text.delta" in raw

    assert len(calls) == 1 and len(calls[0]) <= 12
    assert isinstance(result.final_output, Report)
    call, output = ([i for i in result.new_items if isinstance(i, kind)] for kind in (ToolCallItem, ToolCallOutputItem))
    assert len(call) == len(output) == 1
    assert call[0].raw_item.name == "get_weather" and call[0].raw_item.call_id.startswith("call_")
    assert output[0].raw_item["call_id"] == call[0].raw_item.call_id
    assert json.loads(call[0].raw_item.arguments) == {"city": calls[0]}
    assert output[0].output == f"sunny, 18 degrees in {calls[0]}"

    first, second = result.raw_responses
    assert second.usage.input_tokens > first.usage.input_tokens
    usage = result.context_wrapper.usage
    assert usage.requests == 2
    assert usage.input_tokens == first.usage.input_tokens + second.usage.input_tokens
    assert usage.output_tokens == first.usage.output_tokens + second.usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if api == "responses":
        assert first.response_id.startswith("resp_") and first.response_id != second.response_id
