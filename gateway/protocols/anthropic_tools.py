"""Anthropic's tools, effort and context edits in the internal form.

Tools come in three kinds (Anthropic's "Tool use" docs):

- **client tools** with an ``input_schema`` (``type`` absent or ``custom``): offered as
  they are; ``defer_loading`` ones stay out of the prompt until a tool search loads them
  (a ``tool_reference`` in a tool result, shown there), their calls understood all along;
- **Anthropic-defined client tools** (``bash_20250124``, ``text_editor_20250728``,
  ``memory_20250818``, ``computer_20250124``, ...): the client runs them, the API knows
  their input; offered with the input :data:`CLIENT_TOOL_SCHEMAS` describes (any object
  for a family it does not name);
- **server tools** the API runs itself (``web_search_...``, ``web_fetch_...``,
  ``code_execution_...``, ``tool_search_tool_regex_...``, MCP toolsets, ...): the gateway
  runs none, so they are left out of the prompt and named in the response's
  :data:`gateway.conversation.tools.OMITTED_TOOLS_HEADER`; forcing one with
  ``tool_choice`` is a 400. When the request relies on the server's tool search
  (``tool_search_tool_regex_...``, ``..._bm25_...``) to load its deferred tools, nothing
  would ever load them here, so they are shown with the others from the start (the
  nearest form the model can use); a client's own tool search (Claude Code's) keeps them
  deferred.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from gateway.conversation.context_edits import DEFAULT_KEEP_USES, DEFAULT_TRIGGER_TOKENS, ClearThinking, \
    ClearToolUses, Edit
from gateway.conversation.form import FunctionTool
from gateway.protocols.anthropic_schemas import ContextManagement, EditAmount, Tool

CLIENT_TOOL_SCHEMAS = {
    "bash": {"type": "object", "properties": {"command": {"type": "string"}, "restart": {"type": "boolean"}}},
    "text_editor": {"type": "object", "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string"}, "file_text": {"type": "string"}, "old_str": {"type": "string"},
        "new_str": {"type": "string"}, "insert_line": {"type": "integer"},
        "view_range": {"type": "array", "items": {"type": "integer"}}}, "required": ["command", "path"]},
    "memory": {"type": "object", "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
        "path": {"type": "string"}}, "required": ["command"]},
    "computer": {"type": "object", "properties": {
        "action": {"type": "string"}, "coordinate": {"type": "array", "items": {"type": "integer"}},
        "text": {"type": "string"}}, "required": ["action"]},
}
CLIENT_FAMILIES = frozenset(CLIENT_TOOL_SCHEMAS)

# Thinking budgets (tokens) for output_config.effort, when thinking is on without a budget
# of its own. Anthropic does not publish token figures for effort levels; these follow
# the budgets its extended-thinking docs use as examples, doubling per level.
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None}


def family(kind: str) -> str:
    """A versioned tool type's family: ``bash_20250124`` -> ``bash``."""
    return re.sub(r"_\d{8}$", "", kind)


def is_server_tool(tool: Tool) -> bool:
    """A tool the API runs itself (not a client tool, not an Anthropic-defined client tool)."""
    return tool.type not in (None, "custom") and family(tool.type) not in CLIENT_FAMILIES


def split_tools(tools: list[Tool]) -> tuple[list[FunctionTool], list[str]]:
    """The tools the model is offered, and the server tools left out (their ``name``)."""
    search = any(is_server_tool(t) and family(t.type).startswith("tool_search") for t in tools)
    offered, omitted = [], []
    for i, t in enumerate(tools):
        if is_server_tool(t):
            omitted.append(t.name)
            continue
        schema = t.input_schema if t.input_schema is not None else CLIENT_TOOL_SCHEMAS.get(
            family(t.type or ""), {"type": "object"})
        offered.append(FunctionTool(t.name, t.description, schema, f"tools.{i}", "input_schema",
                                    strict=bool(t.strict), deferred=bool(t.defer_loading) and not search))
    return offered, omitted


def loaded_tool_text(tool: Optional[Tool], name: str) -> str:
    """What a ``tool_reference`` shows the model where it loads a deferred tool: its
    definition (name, description, input schema) as JSON."""
    if tool is None:
        return f"Tool {name} is not available."
    definition = {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema}
    return "Tool loaded: " + json.dumps({k: v for k, v in definition.items() if v is not None}, ensure_ascii=False)


def context_edits(cm: Optional[ContextManagement]) -> list[Edit]:
    """``context_management.edits`` as edits (types the gateway does not know are left
    out, as a server applies only the edits it knows), with Anthropic's defaults:
    ``clear_tool_uses_20250919`` triggers at 100,000 input tokens and keeps 3 tool uses;
    ``clear_thinking_20251015`` keeps the latest thinking turn (``keep: "all"`` keeps all)."""
    out: list[Edit] = []
    for e in cm.edits if cm is not None else []:
        keep = e.keep.value if isinstance(e.keep, EditAmount) else None
        if e.type.startswith("clear_tool_uses"):
            trigger = e.trigger or EditAmount(type="input_tokens", value=DEFAULT_TRIGGER_TOKENS)
            uses = trigger.type == "tool_uses"
            inputs = e.clear_tool_inputs
            out.append(ClearToolUses(
                trigger_tokens=None if uses else trigger.value, trigger_uses=trigger.value if uses else None,
                keep=DEFAULT_KEEP_USES if keep is None else keep,
                clear_at_least=e.clear_at_least.value if e.clear_at_least is not None else 0,
                exclude=frozenset(e.exclude_tools or ()),
                clear_inputs=frozenset(inputs) if isinstance(inputs, list) else bool(inputs), type=e.type))
        elif e.type.startswith("clear_thinking"):
            out.append(ClearThinking(None if e.keep == "all" else 1 if keep is None else keep, e.type))
    return out
