"""pydantic-ai over the gateway's OpenAI Chat Completions (``OpenAIChatModel``) and
Anthropic Messages (``AnthropicModel``) APIs: an agent with a tool and a structured result.

The structured result is pydantic-ai's output tool (``final_result``); a capability forces
the function tool on the first model request and the output tool on the next ones
(pydantic-ai's documented way to vary ``tool_choice`` per step: a random-weight model
left to choose between the two may call the function again), so the model ends the run
with the output tool. Checked, for each provider: two model requests, the function
call's id on its tool return, the provider's id form (``call_``, ``toolu_``), the output an
instance of the model, the usage sums, a longer prompt on the second request, the demo
model's reasoning before its forced call as a ``ThinkingPart``, and, for Anthropic, that
pydantic-ai's ``input_tokens`` is the whole prompt (``input_tokens + cache_read +
cache_creation``). A prompt over the context is pydantic-ai's
``ModelContextWindowExceededError`` with each API's code and words.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import anthropic
import openai
import pytest

from .common import CONTEXT, MODEL, Report, weather_tool

PROVIDERS = ["openai", "anthropic"]


@contextlib.asynccontextmanager
async def model(gateway, provider: str):
    """The provider's pydantic-ai model over an SDK client of the gateway, closed at the end."""
    if provider == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        async with openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=60) as client:
            yield OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))
        return
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60) as client:
        yield AnthropicModel(MODEL, provider=AnthropicProvider(anthropic_client=client))


def first_step_forces(tool_name: str, then: str = "final_result"):
    """A capability: the first model request must call ``tool_name``, later ones ``then``
    (the output tool)."""
    from pydantic_ai.capabilities import AbstractCapability

    @dataclass
    class FirstStepForces(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {"tool_choice": [tool_name] if ctx.run_step <= 1 else [then]}

    return FirstStepForces()


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_agent_with_a_tool_and_a_structured_result(gateway, provider):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, ThinkingPart, ToolCallPart, ToolReturnPart

    calls: list[str] = []
    async with model(gateway, provider) as llm:
        agent = Agent(llm, output_type=Report, tools=[weather_tool(calls)],
                      capabilities=[first_step_forces("get_weather")], model_settings={"temperature": 0, "max_tokens": 160})
        result = await agent.run("Weather in Oslo?")

    assert isinstance(result.output, Report)
    assert len(calls) == 1 and len(calls[0]) <= 12
    messages = result.all_messages()
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert len(responses) == 2 and all(r.model_name == MODEL for r in responses)
    tool_calls = [[p for p in r.parts if isinstance(p, ToolCallPart)] for r in responses]
    assert [[p.tool_name for p in c] for c in tool_calls] == [["get_weather"], ["final_result"]]
    assert tool_calls[0][0].args_as_dict() == {"city": calls[0]}
    prefix = {"openai": "call_", "anthropic": "toolu_"}[provider]
    assert all(c[0].tool_call_id.startswith(prefix) for c in tool_calls)
    returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [(p.tool_name, p.tool_call_id) for p in returns][0] == ("get_weather", tool_calls[0][0].tool_call_id)
    assert all(r.finish_reason == "tool_call" for r in responses)
    # The demo model thinks before its forced call (reasoning_content, a thinking block).
    assert isinstance(responses[0].parts[0], ThinkingPart)

    usage = result.usage
    assert (usage.requests, usage.tool_calls) == (2, 1)
    assert usage.input_tokens == sum(r.usage.input_tokens for r in responses)
    assert usage.output_tokens == sum(r.usage.output_tokens for r in responses)
    assert responses[1].usage.input_tokens > responses[0].usage.input_tokens
    if provider == "anthropic":
        for r in responses:
            d = r.usage.details
            assert r.usage.input_tokens == d["input_tokens"] + d["cache_read_input_tokens"] + d[
                "cache_creation_input_tokens"]
            assert r.provider_response_id.startswith("msg_")


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_prompt_over_the_context_window(gateway, provider):
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ModelContextWindowExceededError

    async with model(gateway, provider) as llm:
        with pytest.raises(ModelContextWindowExceededError) as err:
            await Agent(llm, model_settings={"max_tokens": 16}).run("word " * (CONTEXT + 100))
    assert err.value.status_code == 400
    body = err.value.body
    if provider == "openai":
        assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
        assert re.fullmatch(rf"This model's maximum context length is {CONTEXT} tokens\. However, your messages "
                            r"resulted in (\d+) tokens\..*", body["message"])
    else:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        m = re.fullmatch(rf"prompt is too long: (\d+) tokens > {CONTEXT} maximum", body["error"]["message"])
        assert m and int(m.group(1)) > CONTEXT
