"""Anthropic Messages as coding agents send it (Claude Code's shapes), through the official
anthropic SDK against a real gateway: system messages inside ``messages``, the
billing-header block, ``output_config.effort``, context edits with ``applied_edits``,
deferred tools loaded by ``tool_reference``, server tools, Anthropic-defined client tools,
and ``count_tokens`` equal to the prompt a request takes.

Tiny random-weight qwen3 on the real Qwen3 tokenizer (a template that thinks and renders
tools in its system turn), and Gemma 3's template for the fold of system messages it
cannot show.
"""

from __future__ import annotations

import inspect
import json

import anthropic
import pytest

from conftest import live_server, load_tokenizer, model_path
from gateway.conversation.prompts import render_chat
from gateway.protocols.anthropic import to_conversation
from gateway.protocols.anthropic_schemas import MessagesRequest
from gateway.protocols.anthropic_tools import EFFORT_BUDGETS

BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=sdk-cli; cch={};"
ENV = "# Environment\nPrimary working directory: /tmp/work\nPlatform: linux"
BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
DEFERRED = {"name": "NotebookEdit", "description": "Edit a notebook cell.", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"cell": {"type": "integer"}}, "required": ["cell"]}}
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3", "qwen3"), max_tokens=16) as s:
        yield s


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def body(**extra) -> dict:
    """Claude Code's first request of a turn, in small: billing block and system prompt,
    a user message, then its environment as a system message."""
    return {"model": "test-model", "max_tokens": 8, "temperature": 0, "thinking": NO_THINKING,
            "system": [{"type": "text", "text": BILLING.format("abc", "1a2b3")},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files here."}]},
                         {"role": "system", "content": [{"type": "text", "text": ENV}]}],
            "tools": [BASH], **extra}


def sdk_args(method, b: dict) -> dict:
    """``b`` as the SDK method's keyword arguments: what it does not name (this SDK version
    has no ``temperature``, ``context_management``, ...) goes in ``extra_body``."""
    named = inspect.signature(method).parameters
    extra = {k: v for k, v in b.items() if k not in named}
    return {**{k: v for k, v in b.items() if k in named}, **({"extra_body": extra} if extra else {})}


def create(server, **kw):
    messages = claude(server).messages
    raw = messages.with_raw_response.create(**sdk_args(messages.create, kw))
    return raw.http_response, raw.parse()


def count(server, b: dict) -> int:
    messages = claude(server).messages
    b = {k: v for k, v in b.items() if k not in ("max_tokens", "temperature", "stream")}
    return messages.count_tokens(**sdk_args(messages.count_tokens, b)).input_tokens


def prompt_text(server, b: dict) -> str:
    """The prompt ``b`` renders to (the same code path as the server's)."""
    conv, _ = to_conversation(MessagesRequest.model_validate(b))
    from gateway.conversation.prepare import render_conversation
    from gateway.conversation.tools import plan_tools

    model = server.model
    return model.tokenizer.decode(render_conversation(model, conv, plan_tools(conv, model.tokenizer)).tokens)


def test_a_system_message_inside_messages_is_rendered_where_it_stands(server):
    r, m = create(server, **body())
    assert r.status_code == 200 and m.usage.input_tokens + m.usage.cache_read_input_tokens + \
        m.usage.cache_creation_input_tokens == count(server, body())
    text = prompt_text(server, body())
    # Qwen3's template shows a later system message as a system turn of its own, in place.
    assert text.index("List the files here.") < text.index(f"<|im_start|>system\n{ENV}<|im_end|>")
    assert text[text.index(ENV):].startswith(f"{ENV}<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_cannot_show_it_gets_it_folded_into_the_user_turn_before_it(tokenizers_dir):
    """Gemma 3's template has no system role: a later system message joins the last user
    message before it, so the next turn, which only adds messages after it, renders the
    same prefix (and the prefix cache serves it)."""
    tok = load_tokenizer(model_path("gemma3_text"))
    conv, _ = to_conversation(MessagesRequest.model_validate(body()))
    first = tok.decode(render_chat(tok, conv, {}, 4096).tokens)
    assert "<start_of_turn>system" not in first and f"List the files here.\n\n{ENV}" in first
    b = body()
    b["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]
    conv, _ = to_conversation(MessagesRequest.model_validate(b))
    second = tok.decode(render_chat(tok, conv, {}, 4096, ).tokens)
    cut = first.rindex("<end_of_turn>")
    assert second.startswith(first[:cut]), (first, second)  # the first turn renders the same
    # With no user message before it, it goes before the text of the one after it.
    b = body()
    b["messages"] = [b["messages"][1], b["messages"][0]]
    conv, _ = to_conversation(MessagesRequest.model_validate(b))
    assert f"{ENV}\n\nList the files here." in tok.decode(render_chat(tok, conv, {}, 4096).tokens)


def test_the_billing_block_never_reaches_the_prompt(server):
    first = body()
    again = body()
    again["system"][0]["text"] = BILLING.format("def", "9z8y7")  # a new nonce, as Claude Code sends each time
    assert "cc_version" not in prompt_text(server, first)
    assert count(server, first) == count(server, again)
    _, a = create(server, **first)
    _, b = create(server, **again)
    total = b.usage.input_tokens + b.usage.cache_read_input_tokens + b.usage.cache_creation_input_tokens
    assert b.usage.cache_read_input_tokens >= total - 4, b.usage  # the whole prompt but its last token(s)


def test_effort_sets_the_thinking_budget():
    for effort, budget in EFFORT_BUDGETS.items():
        conv, _ = to_conversation(MessagesRequest.model_validate(
            body(thinking={"type": "adaptive"}, output_config={"effort": effort})))
        assert conv.thinking_budget == budget
    conv, _ = to_conversation(MessagesRequest.model_validate(body(output_config={"effort": "low"})))
    assert conv.thinking_budget is None  # thinking disabled: nothing to budget
    conv, _ = to_conversation(MessagesRequest.model_validate(
        body(thinking={"type": "enabled", "budget_tokens": 77}, output_config={"effort": "low"})))
    assert conv.thinking_budget == 77  # an explicit budget wins


def tool_loop(n: int) -> list[dict]:
    """``n`` rounds of a Bash call and its (long) result, then a question."""
    messages = [{"role": "user", "content": "Look around."}]
    for i in range(n):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"I should run command {i}.", "signature": ""},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": f"ls dir{i}"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"file{i}.txt " * 40}]})
    messages.append({"role": "user", "content": "What did you find?"})
    return messages


def test_context_edits_clear_old_tool_results_and_report_what_they_did(server):
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                        "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True}]}
    b = body(messages=tool_loop(3), context_management=edits)
    plain = body(messages=tool_loop(3))
    r, m = create(server, **b)
    assert r.status_code == 200
    applied = m.model_dump()["context_management"]["applied_edits"]
    assert [e["type"] for e in applied] == ["clear_tool_uses_20250919"]
    assert applied[0]["cleared_tool_uses"] == 2 and applied[0]["cleared_input_tokens"] > 100
    edited, full = count(server, b), count(server, plain)
    assert edited < full - 100  # two results of ~80 tokens and their inputs are gone
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens == edited
    text = prompt_text(server, b)
    assert text.count("file0.txt") == 0 and text.count("file2.txt") == 40 and "ls dir0" not in text
    # Under the trigger nothing is cleared, and nothing is reported.
    _, m = create(server, **body(messages=tool_loop(3), context_management={"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100_000}}]}))
    assert m.model_dump()["context_management"]["applied_edits"] == []


def test_clear_thinking_keeps_the_latest_turns_and_keep_all_keeps_every_one(server):
    thinking = {"type": "enabled", "budget_tokens": 4}
    keep_one = body(messages=tool_loop(3), thinking=thinking,
                    context_management={"edits": [{"type": "clear_thinking_20251015",
                                                   "keep": {"type": "thinking_turns", "value": 1}}]})
    _, m = create(server, **keep_one)
    (edit,) = m.model_dump()["context_management"]["applied_edits"]
    assert edit["type"] == "clear_thinking_20251015" and edit["cleared_thinking_turns"] == 2
    keep_all = dict(keep_one, context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    _, m = create(server, **keep_all)
    assert m.model_dump()["context_management"]["applied_edits"] == []


def test_a_deferred_tool_stays_out_of_the_prompt_until_a_tool_reference_loads_it(server):
    b = body(tools=[BASH, DEFERRED])
    assert "NotebookEdit" not in prompt_text(server, b)
    assert count(server, b) == count(server, body(tools=[BASH]))
    loaded = body(tools=[BASH, DEFERRED], messages=[
        {"role": "user", "content": "Edit the notebook."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "ToolSearch",
                                           "input": {"query": "notebook"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                      "content": [{"type": "tool_reference", "tool_name": "NotebookEdit"}]}]}])
    text = prompt_text(server, loaded)
    assert "Tool loaded:" in text and '"name": "NotebookEdit"' in text
    assert text.index("Tool loaded:") > text.index("Edit the notebook.")  # where it was loaded
    # Its calls are understood: forced, the answer is a call of it.
    _, m = create(server, **dict(loaded, tool_choice={"type": "tool", "name": "NotebookEdit"}, max_tokens=40))
    (call,) = [c for c in m.content if c.type == "tool_use"]
    assert call.name == "NotebookEdit" and set(call.input) <= {"cell"}


def test_server_tools_are_left_out_and_named_and_forcing_one_is_a_400(server):
    tools = [BASH, {"type": "web_search_20250305", "name": "web_search"},
             {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}]
    r, m = create(server, **body(tools=tools))
    assert r.status_code == 200
    assert r.headers["x-gateway-omitted-tools"] == "web_search,tool_search_tool_regex"
    assert "web_search" not in prompt_text(server, body(tools=tools))
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, **body(tools=tools, tool_choice={"type": "tool", "name": "web_search"}))
    assert "tool_choice" in e.value.body["error"]["message"]
    # With the server's tool search (which the gateway does not run), deferred tools are shown.
    assert "NotebookEdit" in prompt_text(server, body(tools=tools + [DEFERRED]))


def test_anthropic_defined_client_tools_are_offered_with_their_input(server):
    b = body(tools=[{"type": "bash_20250124", "name": "bash"}], tool_choice={"type": "tool", "name": "bash"},
             max_tokens=40)
    r, m = create(server, **b)
    (call,) = [c for c in m.content if c.type == "tool_use"]
    assert call.name == "bash" and set(call.input) <= {"command", "restart"}


def test_search_results_and_server_tool_blocks_in_history_are_accepted(server):
    b = body(messages=[
        {"role": "user", "content": [{"type": "search_result", "source": "https://e.x/a", "title": "A",
                                      "content": [{"type": "text", "text": "alpha facts"}]},
                                     {"type": "text", "text": "Summarize."}]},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "alpha"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [{"type": "x", "url": "u"}]},
            {"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Thanks."}])
    r, _ = create(server, **b)
    assert r.status_code == 200
    assert "alpha facts" in prompt_text(server, b)


def test_streamed_edits_come_in_the_message_delta(server):
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                        "keep": {"type": "tool_uses", "value": 2}}]}
    messages = claude(server).messages
    with messages.stream(**sdk_args(messages.stream, body(messages=tool_loop(3), context_management=edits))) as s:
        events = [json.loads(e.model_dump_json()) for e in s if e.type == "message_delta"]
    (delta,) = events
    assert delta["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 1



@pytest.mark.parametrize("edit,param", [
    ({"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": "x"}}, "trigger.value"),
    ({"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}, "keep"),
    ({"type": "clear_thinking_20251015", "keep": {"value": "all"}}, "keep"),
])
def test_a_bad_context_edit_is_a_400_naming_it(server, edit, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, **body(context_management={"edits": [edit]}))
    assert e.value.body["error"]["message"].startswith(f"context_management.edits.0.{param}"), e.value.body


def test_an_image_in_a_tool_result_is_refused_by_a_text_model_naming_images(server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    b = body(messages=[
        {"role": "user", "content": "Read the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_r", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_r",
                                      "content": [{"type": "text", "text": "a picture:"}, image]}]}])
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, **b)
    assert "does not accept images" in e.value.body["error"]["message"], e.value.body
