"""Grammars of tool calls: what a forced call (``required``, a named tool) must look like,
and what a call the model chooses to make (``auto``) is held to once it begins.

A call is compact JSON, ``{"name":"N","arguments":A}``, name first (what
:mod:`gateway.conversation.tool_stream` reads as it streams). Each offered tool gets a
rule of its own, the name a literal and the arguments a sub-grammar, so that tools held
to different rules sit side by side in one grammar:

- a function's arguments follow its JSON Schema, strictly or relaxed
  (:func:`gateway.conversation.schemas.enforced`: a non-strict tool whose schema
  llguidance cannot compile takes any JSON object, never a 400);
- a ``custom`` tool's arguments are ``{"input":"..."}``, the input a JSON string; with a
  Lark or regex ``format`` it is the grammar's language as it reads inside a JSON
  string (:mod:`gateway.conversation.escaped_grammar`), so the text the client gets
  back after unescaping follows the grammar.

The tagged ``json_tools`` format (Qwen3, Hermes) wraps each call in its tags; the bare
json format (Llama 3, templates without tools) is one call, or an array of them.
"""

from __future__ import annotations

import json
from typing import Optional

from gateway.conversation.escaped_grammar import GrammarConversionError, escaped_lark, escaped_regex
from gateway.conversation.form import FunctionTool
from gateway.conversation.schemas import ANY_OBJECT, enforced, json_lark
from gateway.conversation.tools import EMPTY_PARAMETERS, ToolPlan
from gateway.http.errors import APIError
from scheduler.grammar import Grammars


def _arguments(i: int, tool: FunctionTool, grammars: Grammars) -> str:
    """Lark rules whose rule ``args<i>`` matches the arguments of a call of ``tool``.

    Raises:
        APIError: 400 for a strict schema the engine cannot enforce, or a custom tool's
            grammar that cannot be read.
    """
    if tool.kind != "custom":
        params = tool.parameters if tool.parameters is not None else EMPTY_PARAMETERS
        schema = enforced(grammars, params, tool.strict, f"{tool.param}.{tool.schema_key}", ANY_OBJECT)
        return f"args{i}: {json_lark(schema, relaxed=not tool.strict)}"
    if tool.grammar is None:
        return f'args{i}: "{{\\"input\\":" {json_lark({"type": "string"})} "}}"'
    syntax, definition = tool.grammar
    try:
        rules, root = (escaped_lark if syntax == "lark" else escaped_regex)(definition, f"c{i}")
    except GrammarConversionError as e:
        raise APIError(400, f"the {syntax} grammar of custom tool '{tool.name}' cannot be used: {e}",
                       param=f"{tool.param}.format.definition")
    return f'{rules}\nargs{i}: "{{\\"input\\":\\"" {root} "\\"}}"'


def _one_call(plan: ToolPlan, grammars: Grammars) -> str:
    """Rules whose rule ``obj`` is one call of any tool the plan lets the model call now
    (only the forced one under a named choice, only the allowed ones under
    ``allowed_tools``)."""
    rules, alternatives = [], []
    for i, (name, tool) in enumerate(plan.offered.items()):
        if not plan.callable(name):
            continue
        rules.append(_arguments(i, tool, grammars))
        head = json.dumps(f'{{"name":"{name}","arguments":')
        rules.append(f'call{i}: {head} args{i} "}}"')
        alternatives.append(f"call{i}")
    return "\n".join([f"obj: {' | '.join(alternatives)}"] + rules)


def call_lark(plan: ToolPlan, grammars: Grammars, root: str = "start") -> Optional[str]:
    """Lark rules, rooted at ``root``, that force a call (``required``/named choice), else
    None: tagged blocks for ``json_tools`` models, else one bare call (or, with parallel
    calls, an array of them).

    Raises:
        APIError: 400 from a tool's schema or grammar (:func:`_arguments`).
    """
    if plan.choice not in ("required", "function"):
        return None
    literal = grammars.lark_literal
    one = _one_call(plan, grammars)
    if plan.format.is_json_tools:
        start, end = literal(plan.format.start), literal(plan.format.end)
        rule = f'{root}: call ("\\n" call)*' if plan.parallel else f"{root}: call"
        return f'{rule}\ncall: {start} "\\n" obj "\\n" {end}\n{one}'
    if plan.parallel:
        return f'{root}: obj | "[" obj ("," obj)* "]"\n{one}'
    return f"{root}: obj\n{one}"


def lazy_call_lark(plan: Optional[ToolPlan], grammars: Grammars) -> Optional[str]:
    """Lark rules for ``tool_choice`` ``auto`` where the model's call tag is one special
    token (Qwen3's and Hermes-style ``<tool_call>``): any tokens but that tag (free text,
    reasoning included), then, once the model writes the tag, calls of offered tools
    whose arguments follow their rules. None where that does not apply: no tools, another
    choice, or a call that starts as text (Llama 3's JSON calls), which a token mask
    cannot wait for without constraining the text before it.

    llguidance reads ``<[^id]>`` as any token but ``id``; a trigger-started grammar as
    llama.cpp's lazy grammars are, expressed as one grammar.

    Raises:
        APIError: 400 from a strict tool's schema or a custom tool's grammar.
    """
    if plan is None or plan.choice != "auto" or not plan.format.is_json_tools:
        return None
    start = grammars.lark_literal(plan.format.start)
    if not (start.startswith("<[") and start.endswith("]>")):
        return None
    calls = 'calls: call ("\\n" call)*' if plan.parallel else "calls: call"
    return (f"start: free calls?\nfree: <[^{start[2:-2]}]>*\n{calls}\n"
            f'call: {start} "\\n" obj "\\n" {grammars.lark_literal(plan.format.end)}\n{_one_call(plan, grammars)}')

