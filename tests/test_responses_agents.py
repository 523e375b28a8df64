"""The Responses API as Codex CLI sends it, through the official openai SDK against a real
gateway: ``namespace`` tools, ``custom`` tools held to a Lark or regex grammar,
``local_shell``, hosted tools, ``developer`` messages, and sealed reasoning
(``include: ["reasoning.encrypted_content"]`` with ``store: false``) that renders the same
prompt again and is served from the prefix cache.

Tiny random-weight qwen3 on the real Qwen3 tokenizer (it thinks, and its tool calls are
``<tool_call>`` blocks).
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from conftest import live_server, model_path
from gateway.protocols.reasoning_seal import ReasoningSeal

NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"target": {"type": "string", "maxLength": 8}},
                    "required": ["target"], "additionalProperties": False}}]}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string", "maxLength": 12}},
                       "required": ["cmd"]}}
GREETING = 'start: "hello " NAME "!"\nNAME: /[a-z]{1,8}/\n'
CUSTOM = {"type": "custom", "name": "greet", "description": "Greet someone.",
          "format": {"type": "grammar", "syntax": "lark", "definition": GREETING}}
CODE = {"type": "custom", "name": "code", "description": "A code.",
        "format": {"type": "grammar", "syntax": "regex", "definition": r'[A-Z]{2}-\d{3}"?\n?'}}
NO_THINKING = {"effort": "none"}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=48) as s:
        yield s


def respond(server, **kw):
    raw = server.openai().responses.with_raw_response.create(model="test-model", **kw)
    return raw.http_response, raw.parse()


def test_a_namespace_tools_function_is_called_and_answered_with_its_namespace(server):
    _, r = respond(server, input="Close agent a1.", tools=[EXEC, NAMESPACE], reasoning=NO_THINKING,
                   tool_choice={"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"})
    (call,) = [o for o in r.output if o.type == "function_call"]
    raw = call.model_dump()
    assert raw["name"] == "close_agent" and raw["namespace"] == "multi_agent_v1"
    assert set(json.loads(call.arguments)) <= {"target"}
    # Sent back as Codex sends it, with its output: the next turn renders it and reuses the prefix.
    _, again = respond(server, tools=[EXEC, NAMESPACE], reasoning=NO_THINKING, store=False, input=[
        {"role": "user", "content": "Close agent a1."}, raw,
        {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
        {"role": "user", "content": "Thanks."}])
    assert again.status == "completed" or again.status == "incomplete"
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_custom_tools_input_follows_its_lark_grammar(server):
    _, r = respond(server, input="Greet Ann.", tools=[CUSTOM], reasoning=NO_THINKING,
                   tool_choice={"type": "custom", "name": "greet"}, max_output_tokens=40)
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "greet" and re.fullmatch(r"hello [a-z]{1,8}!", call.input), call.input
    # Streamed: its input arrives as custom_tool_call_input events, the same text.
    with server.openai().responses.stream(model="test-model", input="Greet Ann.", tools=[CUSTOM],
                                          reasoning=NO_THINKING, tool_choice={"type": "custom", "name": "greet"},
                                          max_output_tokens=40) as s:
        events = list(s)
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert len(done) == 1 and done[0].input == deltas and re.fullmatch(r"hello [a-z]{1,8}!", deltas)
    # Its call and output come back as input items.
    _, again = respond(server, tools=[CUSTOM], reasoning=NO_THINKING, input=[
        {"role": "user", "content": "Greet Ann."}, call.model_dump(),
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "greeted"}])
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_regex_custom_tool_and_escapes_in_its_input(server):
    _, r = respond(server, input="A code?", tools=[CODE], reasoning=NO_THINKING,
                   tool_choice={"type": "custom", "name": "code"}, max_output_tokens=40)
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert re.fullmatch(r'[A-Z]{2}-\d{3}"?\n?', call.input), call.input


def test_local_shell_calls_carry_their_action(server):
    _, r = respond(server, input="List files.", tools=[{"type": "local_shell"}], reasoning=NO_THINKING,
                   tool_choice={"type": "function", "name": "local_shell"}, max_output_tokens=48)
    (call,) = [o.model_dump() for o in r.output if o.type == "local_shell_call"]
    assert call["action"]["type"] == "exec" and isinstance(call["action"]["command"], list)
    _, again = respond(server, tools=[{"type": "local_shell"}], reasoning=NO_THINKING, input=[
        {"role": "user", "content": "List files."}, call,
        {"type": "local_shell_call_output", "id": call["call_id"], "output": "a.txt"}])
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_hosted_tools_are_left_out_and_named(server):
    http, r = respond(server, input="hi", tools=[EXEC, {"type": "web_search", "external_web_access": False},
                                                  {"type": "mcp", "server_label": "docs", "server_url": "https://x"}],
                      reasoning=NO_THINKING, max_output_tokens=4)
    assert http.headers["x-gateway-omitted-tools"] == "web_search,mcp:docs"
    with pytest.raises(openai.BadRequestError) as e:
        respond(server, input="hi", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"})
    assert e.value.body["param"] == "tool_choice.type"
    # Their calls in an earlier output are accepted, and left out.
    _, again = respond(server, reasoning=NO_THINKING, max_output_tokens=4, input=[
        {"role": "user", "content": "hi"}, {"type": "web_search_call", "id": "ws_1", "status": "completed",
                                           "action": {"type": "search", "query": "x"}},
        {"role": "user", "content": "and?"}])
    assert again.status in ("completed", "incomplete")


def test_developer_messages_anywhere(server):
    _, r = respond(server, reasoning=NO_THINKING, max_output_tokens=4, input=[
        {"role": "developer", "content": "You are terse."}, {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Mind the time."}]},
        {"role": "user", "content": "and?"}])
    assert r.status in ("completed", "incomplete")


@pytest.fixture(scope="module")
def thinker(tokenizers_dir, tmp_path_factory):
    """A tiny qwen3 whose template opens the think block itself (as DeepSeek-R1's and
    GLM's do): Qwen3's template, its generation prompt ending in ``<think>\n`` when
    thinking is on, so even random weights answer with reasoning first."""
    import shutil

    from conftest import _MODEL_CACHE
    from gateway.models.demo_model import build_model_dir

    src = tmp_path_factory.mktemp("tok") / "qwen3-opens-thinking"
    shutil.copytree(tokenizers_dir / "qwen3", src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    head = "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
    assert head in template
    config["chat_template"] = template.replace(head, head + "\n    {%- else %}\n        {{- '<think>\\n' }}")
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    path = build_model_dir(_MODEL_CACHE / "qwen3-opens-thinking", "qwen3", tokenizer_dir=src, vocab_size=151936)
    with live_server(path, max_tokens=48) as s:
        yield s


def agent_step(server, include: bool):
    """A thinking step of an agent loop without server state: forced to call a tool, the
    model reasons (a few tokens, the constrained answer's budget), then calls."""
    kw = {"include": ["reasoning.encrypted_content"]} if include else {}
    first = [{"role": "developer", "content": "Think, then act."}, {"role": "user", "content": "Run ls."}]
    _, r = respond(server, input=first, store=False, tools=[EXEC], tool_choice="required",
                   reasoning={"effort": "medium"}, max_output_tokens=64, **kw)
    return first, r


def follow_up(server, first, reasoning: dict, r, **kw):
    """The loop's next request: the step's output and the tool's result."""
    call = next(o.model_dump() for o in r.output if o.type == "function_call")
    items = first + [reasoning, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}]
    return respond(server, input=items, store=False, tools=[EXEC], reasoning={"effort": "medium"},
                   max_output_tokens=4, **kw)[1]


def test_sealed_reasoning_comes_back_exactly_and_the_next_step_reuses_it(thinker):
    first, r = agent_step(thinker, include=True)
    (reasoning,) = [o.model_dump() for o in r.output if o.type == "reasoning"]
    text = reasoning["content"][0]["text"]
    assert text.strip() and reasoning["encrypted_content"] and text not in reasoning["encrypted_content"]
    # Codex sends the item back without its text: the sealed content alone restores it.
    sealed = {"type": "reasoning", "id": reasoning["id"], "summary": [],
              "encrypted_content": reasoning["encrypted_content"]}
    clear = {"type": "reasoning", "id": reasoning["id"], "summary": [],
             "content": [{"type": "reasoning_text", "text": text}]}
    r2 = follow_up(thinker, first, sealed, r, include=["reasoning.encrypted_content"])
    r3 = follow_up(thinker, first, clear, r)
    assert r2.usage.input_tokens == r3.usage.input_tokens  # the same prompt as with the reasoning in clear
    # Served from the cache through the step's reasoning: its prompt and the reasoning tokens
    # (the call after it is re-rendered by the template in another spacing).
    think = len(thinker.tokenizer.encode(text, add_special_tokens=False))
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens + think - 2, (r.usage, r2.usage)
    # Lost (a changed seal opens to nothing), the step is still served, without that reasoning.
    broken = dict(sealed, encrypted_content=sealed["encrypted_content"][:-6] + "AAAA==")
    r4 = follow_up(thinker, first, broken, r)
    assert r4.usage.input_tokens < r2.usage.input_tokens


def test_without_include_no_reasoning_is_sealed(thinker):
    _, r = agent_step(thinker, include=False)
    assert any(o.type == "reasoning" for o in r.output)
    assert all(o.model_dump().get("encrypted_content") is None for o in r.output if o.type == "reasoning")


def test_a_seal_opens_only_for_its_tenant_and_key():
    seal, other = ReasoningSeal(b"k" * 32), ReasoningSeal(b"o" * 32)
    token = seal.seal("secret thoughts", "alice")
    assert seal.open(token, "alice") == "secret thoughts"
    assert seal.open(token, "bob") is None and other.open(token, "alice") is None
    assert seal.open("not base64!", "alice") is None and seal.open(token[:-8], "alice") is None


def test_a_hosted_tools_label_never_breaks_the_header(server):
    http, _ = respond(server, input="hi", reasoning=NO_THINKING, max_output_tokens=4,
                      tools=[{"type": "mcp", "server_label": "docs\r\nx-evil: 1", "server_url": "https://x"},
                             {"type": "web_search_é"}])
    assert http.status_code == 200 and http.headers["x-gateway-omitted-tools"] == "mcp:docs__x-evil:_1,web_search__"


def test_tool_choice_forms(server):
    _, r = respond(server, input="List files.", tools=[{"type": "local_shell"}, EXEC], reasoning=NO_THINKING,
                   tool_choice={"type": "local_shell"}, max_output_tokens=48)
    assert [o.type for o in r.output if o.type.endswith("call")] == ["local_shell_call"]
    # allowed_tools holds a required call to the tools it lists, whatever else is offered.
    _, r = respond(server, input="Close a1.", tools=[EXEC, NAMESPACE], reasoning=NO_THINKING, max_output_tokens=48,
                   parallel_tool_calls=False, tool_choice={"type": "allowed_tools", "mode": "required", "tools": [
                       {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"}]})
    (call,) = [o.model_dump() for o in r.output if o.type == "function_call"]
    assert (call["name"], call["namespace"]) == ("close_agent", "multi_agent_v1")
    with pytest.raises(openai.BadRequestError) as e:
        respond(server, input="hi", tools=[EXEC], tool_choice={"type": "function"})
    assert e.value.body["param"] == "tool_choice.name"


def test_an_image_in_a_function_output_is_refused_by_a_text_model_naming_images(server):
    with pytest.raises(openai.BadRequestError) as e:
        respond(server, tools=[EXEC], reasoning=NO_THINKING, input=[
            {"role": "user", "content": "Look."},
            {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert "does not accept images" in e.value.body["message"], e.value.body
