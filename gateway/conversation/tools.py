"""Tool calls, whatever API a request came in on: check the request's tools, put them in
the prompt, constrain the output when a call is required, and parse calls out of the text.

Two call formats:

- **tagged**: the model's own format, when mlx-lm's tokenizer wrapper found a tool
  parser for its chat template (``mlx_lm.tool_parsers``: ``json_tools`` for Qwen3 and
  Hermes ``<tool_call>{json}</tool_call>`` blocks, ``pythonic``, ``mistral``, ...). The
  template renders the tools; calls are cut out between the parser's start and end
  tags and parsed by mlx-lm's parser.
- **json**: a bare JSON object ``{"name": ..., "arguments": {...}}`` (or an array of
  them for parallel calls); ``"parameters"`` is read as ``"arguments"``, which is how
  Llama 3.x writes calls. Used for templates with no mlx-lm parser. When the template
  does not render ``tools`` at all (SmolLM2, Gemma 3), the definitions and the format
  go into the system message (:func:`fallback_instructions`), earlier calls are
  rendered as that JSON and tool results as a user turn.

Tools beyond plain functions reach the model as functions too: a Responses
``namespace`` tool's functions as ``<namespace>__<name>`` (:func:`offered_name`), a
``custom`` tool (free-form input) as a function of one string ``input``
(:func:`custom_parameters`). Anthropic's deferred tools (``defer_loading``) stay out of
the prompt until a ``tool_reference`` loads them.

``tool_choice`` ``required`` or a named function is enforced by a grammar
(:mod:`gateway.conversation.call_grammar`): the output is always a call to an offered
tool whose arguments follow its schema (or its grammar). Tagged formats other than
``json_tools`` are constrained to the json format instead (their own syntax has no
JSON-schema form). Calls are read out of the output by
:mod:`gateway.conversation.tool_stream`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gateway.http.errors import APIError
from gateway.conversation.form import Conversation, FunctionTool, Turn
from gateway.conversation.schemas import check_schema

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
NAMESPACE_SEPARATOR = "__"  # a namespace tool's function reaches the model as <namespace>__<name>
# Response header naming the tools of a request that were left out of its prompt (tools the
# API's provider runs itself: web search, code execution, ...), comma-separated.
OMITTED_TOOLS_HEADER = "x-gateway-omitted-tools"
_UNSAFE_IN_HEADER = re.compile(r"[^A-Za-z0-9_.:-]")


def omitted_tools_header(labels: list[str]) -> dict[str, str]:
    """The :data:`OMITTED_TOOLS_HEADER` for ``labels`` (none: no header); characters a
    header value may not hold (they come from the request) written as ``_``."""
    return {OMITTED_TOOLS_HEADER: ",".join(_UNSAFE_IN_HEADER.sub("_", x) for x in labels)} if labels else {}


@dataclass(frozen=True)
class CallFormat:
    """How calls appear in the model's text: ``kind`` is ``"tagged"`` (between
    ``start`` and ``end``, read by mlx-lm's ``parser``) or ``"json"``."""

    kind: str
    start: str = ""
    end: str = ""
    parser: Optional[Callable[[str, Any], Any]] = None

    @property
    def is_json_tools(self) -> bool:
        return self.kind == "tagged" and getattr(self.parser, "__module__", "").endswith("json_tools")


JSON_FORMAT = CallFormat("json")


@dataclass(frozen=True)
class ToolPlan:
    """What one request does with its tools.

    ``tools``: the tools as the template (or the fallback instructions) shows them, in
    OpenAI's ``{"type": "function", "function": ...}`` form, deferred tools left out;
    ``offered``: every tool of the request, by the name the model calls it (a namespace
    tool's function as ``<namespace>__<name>``, :func:`offered_name`); ``allowed``: the
    names it may call now (None: all; Responses' ``allowed_tools``). ``choice`` is
    ``none``, ``auto``, ``required`` or ``function`` (then ``forced`` is the offered
    name); ``in_template``: the chat template renders the tools itself.
    """

    tools: list[dict]
    choice: str
    forced: Optional[str]
    parallel: bool
    format: CallFormat
    in_template: bool
    offered: dict[str, FunctionTool] = field(default_factory=dict)
    allowed: Optional[frozenset[str]] = None

    @property
    def names(self) -> list[str]:
        return list(self.offered)

    def callable(self, name: str) -> bool:
        """Whether a call of ``name`` may be made now (forced, allowed)."""
        return self.forced in (None, name) and (self.allowed is None or name in self.allowed)

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def model_call_format(tokenizer) -> CallFormat:
    """The model's own call format, from mlx-lm's ``TokenizerWrapper``."""
    if getattr(tokenizer, "has_tool_calling", False):
        return CallFormat("tagged", tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser)
    return JSON_FORMAT


def template_renders_tools(tokenizer) -> bool:
    """True when the chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def namespaced(namespace: Optional[str], name: str) -> str:
    """The name the model calls a function by: its own, or ``<namespace>__<name>``."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def offered_name(tool: FunctionTool) -> str:
    """The name the model calls ``tool`` by (:func:`namespaced`)."""
    return namespaced(tool.namespace, tool.name)


def custom_parameters(tool: FunctionTool) -> dict:
    """The arguments a ``custom`` tool's call carries: its free-form input as one string."""
    what = "The tool's input, as free-form text"
    if tool.grammar is not None:
        what += f" following this {tool.grammar[0]} grammar:\n{tool.grammar[1]}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": what}}, "required": ["input"]}


def _shown(tool: FunctionTool, name: str) -> dict:
    """A tool as templates take it (OpenAI's function form)."""
    params = custom_parameters(tool) if tool.kind == "custom" else (
        tool.parameters if tool.parameters is not None else EMPTY_PARAMETERS)
    entry: dict[str, Any] = {"name": name, "parameters": params}
    if tool.description is not None:
        entry["description"] = tool.description
    return {"type": "function", "function": entry}


def plan_tools(conv: Conversation, tokenizer) -> Optional[ToolPlan]:
    """Check the conversation's tools and tool choice, and decide how it uses them.
    Deferred tools are left out of the prompt's tool list (a conversation that loads one
    shows its definition where it was loaded, so the prompt's prefix stays as it was) but
    their calls are understood.

    Returns None when it offers no tools.

    Raises:
        APIError: 400 naming the parameter: duplicate names, a ``parameters`` that is not
            a valid JSON Schema, a forced tool that is not offered, or ``required``/a named
            choice without tools.
    """
    if not conv.tools:
        if conv.tool_choice in ("required", "function"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return None
    tools, offered = [], {}
    for tool in conv.tools:
        name = offered_name(tool)
        if name in offered:
            raise APIError(400, f"duplicate function name '{name}'", param=f"{tool.param}.name")
        if tool.kind != "custom" and tool.parameters is not None:
            check_schema(tool.parameters, f"{tool.param}.{tool.schema_key}")
        offered[name] = tool
        if not tool.deferred:
            tools.append(_shown(tool, name))
    choice, forced = conv.tool_choice, conv.forced_tool
    if choice == "function" and forced not in offered:
        raise APIError(400, f"tool_choice names '{forced}', which is not in tools", param="tool_choice")
    if choice == "function" and forced is not None and not any(t["function"]["name"] == forced for t in tools):
        tools.append(_shown(offered[forced], forced))  # a forced deferred tool is shown
    native = model_call_format(tokenizer)
    fmt = native
    if choice in ("required", "function") and native.kind == "tagged" and not native.is_json_tools:
        fmt = JSON_FORMAT  # constrained to the json format
    parallel = conv.parallel_tool_calls and choice != "function"
    allowed = None if conv.allowed_tools is None else frozenset(conv.allowed_tools) & offered.keys()
    if allowed is not None and not allowed and choice in ("required", "function"):
        raise APIError(400, "tool_choice allows none of the tools offered", param="tool_choice")
    return ToolPlan(tools, choice, forced if choice == "function" else None, parallel, fmt,
                    template_renders_tools(tokenizer), offered, allowed)


# ---------------------------------------------------------------------- prompt
def fallback_instructions(plan: ToolPlan) -> str:
    """The system-message text that offers the tools to a template that cannot."""
    lines = ["You can call these functions:"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in plan.tools]
    lines.append('To call a function, reply with only a JSON object {"name": <function name>, '
                 '"arguments": <arguments object>}' +
                 (", or a JSON array of such objects to call several." if plan.parallel else "."))
    if plan.choice == "required":
        lines.append("You must call a function.")
    elif plan.choice == "function":
        lines.append(f"You must call {plan.forced}.")
    else:
        lines.append("If no function is needed, answer normally.")
    return "\n".join(lines)


def _arguments(call) -> Any:
    """A call's arguments for a template: the parsed object when they are JSON, else the
    text; a custom tool's input as the ``input`` string it was generated as."""
    if call.kind == "custom":
        return {"input": call.arguments}
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _called(call) -> str:
    """The name a call was made by (:func:`namespaced`)."""
    return namespaced(call.namespace, call.name)


def template_messages(turns: list[Turn], plan: Optional[ToolPlan]) -> list[dict[str, Any]]:
    """Turns as the dicts chat templates expect: earlier calls' arguments parsed, and,
    when the template cannot render tools, tools and calls written as text (see the
    module docstring)."""
    fallback = plan is not None and not plan.in_template
    names = {c.id: _called(c) for t in turns for c in t.tool_calls}
    out: list[dict[str, Any]] = []
    for t in turns:
        d: dict[str, Any] = {"role": t.role, "content": t.text}
        if t.reasoning is not None:
            d["reasoning_content"] = t.reasoning
        if t.tool_calls and fallback:
            calls = [{"name": _called(c), "arguments": _arguments(c)} for c in t.tool_calls]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            d["content"] = f"{t.text}\n{text}" if t.text else text
        elif t.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": _called(c), "arguments": _arguments(c)}} for c in t.tool_calls]
        if t.role == "tool":
            if t.tool_call_id is not None:
                d["tool_call_id"] = t.tool_call_id
            name = t.name or names.get(t.tool_call_id or "")
            if name is not None:
                d["name"] = name
            if fallback:
                result = f"Result of {name or 'the function'}: {t.text}"
                if out and out[-1].get("_results"):
                    out[-1]["content"] += "\n" + result
                    continue
                d = {"role": "user", "content": result, "_results": True}
        elif t.name is not None:
            d["name"] = t.name
        if fallback and t.role == "user" and out and out[-1].get("_results"):
            out[-1]["content"] += "\n\n" + t.text  # one user turn: templates that alternate roles
            continue
        out.append(d)
    for d in out:
        d.pop("_results", None)
    if fallback and plan.choice != "none":
        text = fallback_instructions(plan)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
