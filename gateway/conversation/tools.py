"""Tool calls for chat completions: check the request's tools, put them in the prompt,
constrain the output when a call is required, and parse calls out of the text.

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

``tool_choice`` ``required`` or a named function is enforced by a grammar
(:func:`call_lark`): the output is always a call to an offered function whose
arguments validate against its JSON schema. Tagged formats other than ``json_tools``
are constrained to the json format instead (their own syntax has no JSON-schema form).
Calls are read out of the output by :mod:`gateway.conversation.tool_stream`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jsonschema

from gateway.http.errors import APIError
from gateway.conversation.form import Conversation, Turn
from scheduler.grammar import JSON_DEFAULTS

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


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

    ``choice`` is ``none``, ``auto``, ``required`` or ``function`` (then ``forced`` is
    the name); ``in_template``: the chat template renders the tools itself.
    """

    tools: list[dict]
    choice: str
    forced: Optional[str]
    parallel: bool
    format: CallFormat
    in_template: bool

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def model_call_format(tokenizer) -> CallFormat:
    """The model's own call format, from mlx-lm's ``TokenizerWrapper``."""
    if getattr(tokenizer, "has_tool_calling", False):
        return CallFormat("tagged", tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                          tokenizer.tool_parser)
    return JSON_FORMAT


def template_renders_tools(tokenizer) -> bool:
    """True when the chat template reads a ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that names
    its properties and says nothing about others (``additionalProperties``,
    ``patternProperties``, ``unevaluatedProperties``), at any depth; a copy.

    Tool arguments and strict output formats are constrained this way, as vLLM does:
    schemas made by frameworks (langchain's ``@tool``, pydantic) never say
    ``additionalProperties``, and left open the grammar lets a small model write extra
    keys until ``max_tokens``. A schema that allows other properties keeps them.
    """
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_schema(out[key])
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                         "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def check_schema(schema: dict, param: str) -> None:
    """Check that ``schema`` is a valid JSON Schema (its own ``$schema`` dialect, else
    2020-12).

    Raises:
        APIError: 400 naming ``param`` when it is not.
    """
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"invalid JSON Schema: {e.message}", param=param)


def plan_tools(conv: Conversation, tokenizer) -> Optional[ToolPlan]:
    """Check the conversation's tools and tool choice, and decide how it uses them.

    Returns None when it offers no tools.

    Raises:
        APIError: 400 naming the parameter: duplicate function names, a ``parameters``
            that is not a valid JSON Schema, a forced function that is not offered, or
            ``required``/a named choice without tools.
    """
    if not conv.tools:
        if conv.tool_choice in ("required", "function"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return None
    tools, seen = [], set()
    for tool in conv.tools:
        if tool.name in seen:
            raise APIError(400, f"duplicate function name '{tool.name}'", param=f"{tool.param}.name")
        seen.add(tool.name)
        params = tool.parameters if tool.parameters is not None else EMPTY_PARAMETERS
        check_schema(params, f"{tool.param}.{tool.schema_key}")
        entry = {"name": tool.name, "parameters": params}
        if tool.description is not None:
            entry["description"] = tool.description
        tools.append({"type": "function", "function": entry})
    choice, forced = conv.tool_choice, conv.forced_tool
    if choice == "function" and forced not in seen:
        raise APIError(400, f"tool_choice names '{forced}', which is not in tools", param="tool_choice")
    native = model_call_format(tokenizer)
    fmt = native
    if choice in ("required", "function") and native.kind == "tagged" and not native.is_json_tools:
        fmt = JSON_FORMAT  # constrained to the json format
    parallel = conv.parallel_tool_calls and choice != "function"
    return ToolPlan(tools, choice, forced if choice == "function" else None, parallel, fmt,
                    template_renders_tools(tokenizer))


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


def _arguments(text: str) -> Any:
    """Arguments for a template: the parsed object when ``text`` is JSON, else ``text``."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(turns: list[Turn], plan: Optional[ToolPlan]) -> list[dict[str, Any]]:
    """Turns as the dicts chat templates expect: earlier calls' arguments parsed, and,
    when the template cannot render tools, tools and calls written as text (see the
    module docstring)."""
    fallback = plan is not None and not plan.in_template
    names = {c.id: c.name for t in turns for c in t.tool_calls}
    out: list[dict[str, Any]] = []
    for t in turns:
        d: dict[str, Any] = {"role": t.role, "content": t.text}
        if t.reasoning is not None:
            d["reasoning_content"] = t.reasoning
        if t.tool_calls and fallback:
            calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in t.tool_calls]
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            d["content"] = f"{t.text}\n{text}" if t.text else text
        elif t.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _arguments(c.arguments)}} for c in t.tool_calls]
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


# ---------------------------------------------------------------------- grammar
def _call_schema(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": closed_schema(fn["parameters"])},
            "required": ["name", "arguments"], "additionalProperties": False}


def call_lark(plan: ToolPlan, literal: Callable[[str], str] = json.dumps, root: str = "start") -> Optional[str]:
    """Lark rules, rooted at ``root``, that force a call (``required``/named choice), else None.

    ``literal`` turns a tag into a Lark expression (:meth:`Grammars.lark_literal`, for
    tags that are special tokens)."""
    if plan.choice not in ("required", "function"):
        return None
    tools = [t for t in plan.tools if plan.forced in (None, t["function"]["name"])]
    one = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    if plan.format.is_json_tools:
        start, end = literal(plan.format.start), literal(plan.format.end)
        rule = f'{root}: call ("\\n" call)*' if plan.parallel else f"{root}: call"
        return f'{rule}\ncall: {start} "\\n" obj "\\n" {end}\nobj: {json_lark(one)}'
    if plan.parallel:
        one = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]}
    return f"{root}: {json_lark(one)}"


def lazy_call_lark(plan: Optional[ToolPlan], literal: Callable[[str], str]) -> Optional[str]:
    """Lark rules for ``tool_choice`` ``auto`` where the model's call tag is one special
    token (Qwen3's and Hermes-style ``<tool_call>``): any tokens but that tag (free text,
    reasoning included), then, once the model writes the tag, calls whose names and
    arguments follow the offered tools' (closed) schemas. None where that does not apply:
    no tools, another choice, or a call that starts as text (Llama 3's JSON calls), which
    a token mask cannot wait for without constraining the text before it.

    llguidance reads ``<[^id]>`` as any token but ``id``; a trigger-started grammar as
    llama.cpp's lazy grammars are, expressed as one grammar.
    """
    if plan is None or plan.choice != "auto" or not plan.format.is_json_tools:
        return None
    start = literal(plan.format.start)
    if not (start.startswith("<[") and start.endswith("]>")):
        return None
    one = _call_schema(plan.tools[0]) if len(plan.tools) == 1 else {"anyOf": [_call_schema(t) for t in plan.tools]}
    calls = 'calls: call ("\\n" call)*' if plan.parallel else "calls: call"
    return (f"start: free calls?\nfree: <[^{start[2:-2]}]>*\n{calls}\n"
            f'call: {start} "\\n" obj "\\n" {literal(plan.format.end)}\nobj: {json_lark(one)}')


def json_lark(schema: dict) -> str:
    """An inline Lark JSON schema: compact JSON valid for ``schema``."""
    return f'%json {json.dumps({**schema, "x-guidance": JSON_DEFAULTS})}'
