"""litellm against the gateway with both of its prefixes: ``openai/`` (Chat Completions at
``/v1``) and ``anthropic/`` (Messages, which litellm translates to and from its OpenAI form).

- A tool loop: a forced named call (``finish_reason: tool_calls``, a provider id, arguments
  valid for the schema), the same call streamed and rebuilt by ``stream_chunk_builder``
  (same call, same usage), then the tool result answered with a ``response_format`` model
  (for ``anthropic/`` litellm forces a JSON tool of its own and turns it back into content):
  ``finish_reason: stop``, content valid for the model, usage summing up.
- A prompt over the context is mapped by litellm to ``litellm.ContextWindowExceededError``
  from either API's words (OpenAI's ``context_length_exceeded`` message, Anthropic's ``prompt
  is too long: N tokens > M maximum``), with the provider and the 400 kept.

litellm reads its bundled model cost map (``LITELLM_LOCAL_MODEL_COST_MAP``, set in
conftest.py before it is imported), not the one it would download.
"""

from __future__ import annotations

import json

import litellm
import pytest

from .common import CONTEXT, MODEL, WEATHER, Forecast

litellm.suppress_debug_info = True
PREFIXES = ["openai", "anthropic"]


def route(gateway, prefix: str) -> dict:
    base = gateway.v1 if prefix == "openai" else gateway.url
    return dict(model=f"{prefix}/{MODEL}", api_base=base, api_key="unused", num_retries=0, timeout=60)


@pytest.mark.parametrize("prefix", PREFIXES)
def test_tool_loop_stream_and_structured_answer(gateway, prefix):
    kw = route(gateway, prefix)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=160)
    first = litellm.completion(messages=messages, **forced, **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    assert call.id.startswith({"openai": "call_", "anthropic": "toolu_"}[prefix])
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens

    chunks = list(litellm.completion(messages=messages, stream=True, stream_options={"include_usage": True},
                                     **forced, **kw))
    assert len({c.id for c in chunks}) == 1
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    (again,) = rebuilt.choices[0].message.tool_calls
    assert (again.function.name, json.loads(again.function.arguments)) == ("get_weather", args)
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert (rebuilt.usage.prompt_tokens, rebuilt.usage.completion_tokens) == (
        first.usage.prompt_tokens, first.usage.completion_tokens)

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 degrees"}]
    answer = litellm.completion(messages=messages, response_format=Forecast, temperature=0, max_tokens=160, **kw)
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert isinstance(Forecast.model_validate_json(answer.choices[0].message.content), Forecast)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.usage.prompt_tokens > 0 and answer.id != first.id


@pytest.mark.parametrize("prefix", PREFIXES)
def test_context_window_exceeded(gateway, prefix):
    with pytest.raises(litellm.ContextWindowExceededError) as err:
        litellm.completion(messages=[{"role": "user", "content": "word " * (CONTEXT + 100)}], max_tokens=16,
                           **route(gateway, prefix))
    assert err.value.llm_provider == prefix and err.value.status_code == 400
    assert isinstance(err.value, litellm.BadRequestError)
    words = {"openai": f"This model's maximum context length is {CONTEXT} tokens",
             "anthropic": f"tokens > {CONTEXT} maximum"}[prefix]
    assert words in err.value.message
    if prefix == "anthropic":
        assert "prompt is too long: " in err.value.message
