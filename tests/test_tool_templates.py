"""Tools through real chat templates (Qwen3, Llama 3.2, Gemma 3 tokenizers), and calls
parsed out of text by mlx-lm's own parsers, whole and streamed in pieces."""

from __future__ import annotations

import json
import lzma
import random
import shutil

import pytest

from conftest import load_tokenizer
from gateway.http.errors import APIError
from gateway.conversation.prompts import render_chat
from gateway.protocols.openai_chat import to_conversation
from gateway.protocols.openai_schemas import ChatRequest
from gateway.conversation.tool_stream import ToolCallStream
from gateway.conversation.tools import JSON_FORMAT, model_call_format, plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
LOOP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def conv(**body):
    """An OpenAI chat request body as the internal conversation."""
    return to_conversation(ChatRequest(**body))


@pytest.fixture(scope="module")
def tokenizer(tokenizers_dir, tmp_path_factory, request):
    name = request.param
    src = tokenizers_dir / name
    if (src / "tokenizer.json.xz").exists():  # Gemma 3 ships compressed
        dst = tmp_path_factory.mktemp(name)
        for f in src.iterdir():
            if f.suffix != ".xz":
                shutil.copy(f, dst)
        (dst / "tokenizer.json").write_bytes(lzma.decompress((src / "tokenizer.json.xz").read_bytes()))
        src = dst
    return load_tokenizer(src)


def render(tokenizer, messages, **body):
    c = conv(messages=messages, tools=[WEATHER, CLOCK], **body)
    plan = plan_tools(c, tokenizer)
    prompt = render_chat(tokenizer, c, {"date_string": "01 Jan 2026"}, 4096, plan)
    return plan, tokenizer.decode(prompt.tokens)


@pytest.mark.parametrize("tokenizer", ["qwen3"], indirect=True)
def test_qwen3_renders_tools_calls_and_results_in_its_own_format(tokenizer):
    plan, text = render(tokenizer, LOOP)
    assert plan.format.kind == "tagged" and plan.format.is_json_tools and plan.in_template
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("tokenizer", ["llama3"], indirect=True)
def test_llama3_renders_tools_and_calls_as_json(tokenizer):
    plan, text = render(tokenizer, LOOP)
    assert plan.format is JSON_FORMAT and plan.in_template
    assert '"name": "get_weather"' in text and "Cutting Knowledge Date" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text and "18 C, sunny" in text


@pytest.mark.parametrize("tokenizer", ["gemma3"], indirect=True)
def test_template_without_tools_gets_them_in_the_system_message(tokenizer):
    plan, text = render(tokenizer, LOOP + [{"role": "tool", "tool_call_id": "x", "name": "get_time",
                                            "content": "noon"}, {"role": "user", "content": "And tomorrow?"}])
    assert plan.format is JSON_FORMAT and not plan.in_template
    assert "You can call these functions:" in text and '"name": "get_weather"' in text
    assert text.index("You are terse.") < text.index("You can call these functions:")
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    # Results and the user's next words in one user turn, so the template's
    # user/model alternation holds.
    assert "Result of get_weather: 18 C, sunny\nResult of get_time: noon\n\nAnd tomorrow?" in text
    _, text = render(tokenizer, LOOP[1:2], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "You must call get_time." in text
    _, text = render(tokenizer, LOOP[1:2], tool_choice="none")
    assert "You can call these functions" not in text


QWEN_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _assemble(deltas) -> list[tuple]:
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls and d.index == len(calls) and d.name
            calls[d.index] = [d.id, d.name, ""]
        calls[d.index][2] += d.arguments
    return [tuple(c) for _, c in sorted(calls.items())]


def _split_feed(stream: ToolCallStream, text: str, rng: random.Random, most: int = 7):
    """Feed ``text`` in random pieces; the deltas assembled must equal ``stream.calls``."""
    content, deltas, i = "", [], 0
    while i < len(text):
        n = rng.randint(1, most)
        c, d = stream.feed(text[i:i + n])
        content, deltas, i = content + c, deltas + d, i + n
    c, d = stream.finish()
    calls = [(c.id, c.name, c.arguments) for c in stream.calls]
    assert _assemble(deltas + d) == calls
    return content + c, stream.calls


def _plain(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("tokenizer", ["qwen3"], indirect=True)
def test_tagged_calls_parse_the_same_whole_or_in_pieces(tokenizer):
    plan = plan_tools(conv(messages=LOOP[1:2], tools=[WEATHER, CLOCK]), tokenizer)
    assert model_call_format(tokenizer).is_json_tools
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, calls = _split_feed(ToolCallStream(plan), QWEN_TEXT, random.Random(0), most=len(QWEN_TEXT))
    assert content.strip() == "Let me check." and _plain(calls) == expected
    for seed in range(20):
        content, calls = _split_feed(ToolCallStream(plan), QWEN_TEXT, random.Random(seed))
        assert content.strip() == "Let me check." and _plain(calls) == expected
    # A call naming an unknown function, or broken JSON, stays text.
    for bad in ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', "<tool_call>\n{oops\n</tool_call>"):
        assert _split_feed(ToolCallStream(plan), bad, random.Random(0)) == (bad, [])


@pytest.mark.parametrize("tokenizer", ["qwen3", "llama3"], indirect=True)
def test_constrained_calls_stream_their_arguments_as_generated(tokenizer):
    plan = plan_tools(conv(messages=LOOP[1:2], tools=[WEATHER, CLOCK], tool_choice="required"), tokenizer)
    args = '{"city":"Par\\"is {x}","n":[1,{"a":"]"}]}'
    one = '{"name":"get_weather","arguments":' + args + "}"
    text = (f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n" + '{"name":"get_time","arguments":{}}\n</tool_call>'
            if plan.format.is_json_tools else f'[{one},{{"name":"get_time","arguments":{{}}}}]')
    for seed in range(10):
        stream = ToolCallStream(plan)
        content, calls = _split_feed(stream, text, random.Random(seed), most=3)
        assert content == ""
        assert [(c.name, c.arguments) for c in calls] == [
            ("get_weather", args), ("get_time", "{}")]
    # The name goes out before the arguments are complete.
    stream = ToolCallStream(plan)
    head = text[: text.index('"Par') + 4]
    _, deltas = stream.feed(head)
    assert deltas[0].name == "get_weather" and deltas[-1].arguments == '{"city":"Par'


@pytest.mark.parametrize("tokenizer", ["llama3"], indirect=True)
def test_json_calls_parse_objects_and_arrays(tokenizer):
    plan = plan_tools(conv(messages=LOOP[1:2], tools=[WEATHER, CLOCK]), tokenizer)
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    two = '[{"name": "get_time", "arguments": {}}, ' + one + "]"
    assert _plain(_split_feed(ToolCallStream(plan), one, random.Random(1))[1]) == [("get_weather", {"city": "Oslo"})]
    assert _plain(_split_feed(ToolCallStream(plan), two, random.Random(2))[1]) == [
        ("get_time", {}), ("get_weather", {"city": "Oslo"})]
    text = "It is sunny in Oslo {today}."
    assert _split_feed(ToolCallStream(plan), text, random.Random(3)) == (text, [])
    assert _split_feed(ToolCallStream(plan), '{"name": "nope", "arguments": {}}', random.Random(4))[1] == []


@pytest.mark.parametrize("tokenizer", ["qwen3"], indirect=True)
@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_refused_with_the_parameter_path(tokenizer, body, param):
    with pytest.raises(APIError) as e:
        plan_tools(conv(messages=LOOP[1:2], **body), tokenizer)
    assert e.value.status == 400 and e.value.param == param
