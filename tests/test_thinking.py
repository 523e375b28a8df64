"""A thinking model (Qwen3's template thinks unless told not to) under a constrained
answer and under a thinking budget, over real HTTP with the official SDKs.

- ``tool_choice`` required / a JSON schema: the model thinks first, then the grammar
  holds from the end of its think block (as reasoning-aware structured output does
  elsewhere), so the answer is a valid call or valid JSON, and the reasoning stays out of
  the answer;
- the think block is capped: by Anthropic's ``thinking.budget_tokens``, or, before a
  constrained answer, by an eighth of ``max_tokens`` (at most 512 tokens), so the answer
  still fits;
- turned off (``enable_thinking`` false), the constrained answer starts at once.

The model is a tiny random-weight qwen3 with the Qwen3 tokenizer, so its reasoning is
noise: what is checked is where the grammar starts and how many tokens the think block
takes, counted with the model's own tokenizer.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from transformers import AutoTokenizer

from conftest import TOKENIZERS, live_server, model_path

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "ok": {"type": "boolean"}},
         "required": ["x", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Add 2 and 3."}]


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=256) as s:
        yield s


@pytest.fixture(scope="module")
def tokens():
    tok = AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3"))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def test_a_required_call_comes_after_the_think_block_within_its_budget(server):
    max_tokens = 160
    r = server.openai().chat.completions.create(model="test-model", messages=ASK, tools=[ADD],
                                                tool_choice="required", parallel_tool_calls=False,
                                                max_tokens=max_tokens, temperature=0, logprobs=True)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not m.content
    (call,) = m.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    reasoning = (m.model_extra or {}).get("reasoning_content")
    assert reasoning, "the model should have thought first"
    assert "<tool_call>" not in reasoning and "</think>" not in reasoning
    generated = [t.token for t in r.choices[0].logprobs.content]
    assert generated[0] == "<think>" and "</think>" in generated
    assert generated.index("</think>") - 1 <= max_tokens // 8  # the reasoning tokens: the budget
    # usage counts them (between the think tags), streamed or not
    thought = r.usage.completion_tokens_details.reasoning_tokens
    assert generated.index("</think>") - 1 <= thought <= generated.index("</think>") + 1, (thought, generated)
    chunks = list(server.openai().chat.completions.create(
        model="test-model", messages=ASK, tools=[ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought
    # the Responses API counts them the same way (one count, in the shared generation)
    r = server.openai().responses.create(model="test-model", input=ASK[0]["content"], tools=[
        {"type": "function", **ADD["function"]}], tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=max_tokens, temperature=0)
    assert r.usage.output_tokens_details.reasoning_tokens == thought > 0


def test_a_json_schema_answer_comes_after_the_think_block(server):
    r = server.openai().chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "A point."}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT, "strict": True}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(m.content), POINT)
    assert (m.model_extra or {}).get("reasoning_content")


def test_thinking_off_starts_the_constrained_answer_at_once(server):
    r = server.openai().chat.completions.create(
        model="test-model", messages=ASK, tools=[ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not (m.model_extra or {}).get("reasoning_content")
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), ADD["function"]["parameters"])


@pytest.mark.parametrize("budget", [4, 24])
def test_anthropic_budget_tokens_caps_the_thinking_block(server, tokens, budget):
    """The answer is prefilled with the open tag (a random-weight model does not open a
    think block of its own accord; a template that opens it, as thinking-only models'
    do, gives the same prompt)."""
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    r = c.messages.create(model="test-model", max_tokens=200, extra_body={"temperature": 0},
                          thinking={"type": "enabled", "budget_tokens": budget},
                          messages=[{"role": "user", "content": "Think."},
                                    {"role": "assistant", "content": "<think>\n"}])
    kinds = [b.type for b in r.content]
    assert kinds[0] == "thinking", kinds
    assert 0 < tokens(r.content[0].thinking) <= budget + 2  # re-encoding random tokens may split one
    # the block was closed and the answer went on (random weights: text of any kind, or the end)
    assert kinds[1:] == ["text"] or r.stop_reason == "end_turn", kinds
    assert r.usage.output_tokens > tokens(r.content[0].thinking)


def test_under_auto_text_stays_free_and_a_begun_call_follows_its_schema(server):
    """``tool_choice`` auto on a model whose call tag is a special token: the model is
    pushed to open a call (a logit bias on ``<tool_call>``); from the tag on, the grammar
    makes it a valid call of an offered tool, where a random-weight model left alone
    writes noise. Without the bias, text is free (no call is forced)."""
    tag = str(server.gateway.models.handles()[0].tokenizer.convert_tokens_to_ids("<tool_call>"))
    client = server.openai()
    body = dict(model="test-model", messages=ASK, tools=[ADD], tool_choice="auto", parallel_tool_calls=False,
                max_tokens=80, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(logit_bias={tag: 100}, **body)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", m
    (call,) = m.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    free = client.chat.completions.create(**body)
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.content


def test_a_budget_may_close_the_think_block_inside_a_split_character(server):
    """Reasoning that stops on a token ending halfway through a character (byte-level BPE
    splits characters over tokens) can still be closed by the budget: the grammar takes
    any token but the end tag between the tags, not only whole characters (with a text
    rule it allowed nothing there, and the row failed)."""
    from gateway.conversation.prepare import prepare_chat
    from gateway.protocols.openai_chat import to_conversation
    from gateway.protocols.openai_schemas import ChatRequest

    model = server.model
    tok = model.tokenizer
    conv = to_conversation(ChatRequest.model_validate({"messages": ASK, "tools": [ADD], "tool_choice": "required"}))
    prompt, _, mask, (budget,) = prepare_chat(model, conv, max_tokens=32)  # a budget of 4 reasoning tokens
    half = next(i for i in range(1000, len(tok.vocab)) if "\ufffd" in tok.decode([i]))  # a character's first bytes
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    import mlx.core as mx

    tokens = list(prompt.tokens)
    for t in [think, half, half, half, half]:
        logits = budget(mx.array(tokens), mx.zeros((1, model.vocab_size)))
        mask(mx.array(tokens), logits)
        tokens.append(t)
    logits = mask(mx.array(tokens), budget(mx.array(tokens), mx.zeros((1, model.vocab_size))))
    assert mask.error is None
    assert logits[0, end].item() == 0 and mx.isinf(logits[0]).sum().item() == model.vocab_size - 1
