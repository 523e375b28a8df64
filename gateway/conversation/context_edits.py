"""Context edits: prompt changes a server applies before it serves a conversation, as
Anthropic's context management does (``context_management.edits``, beta
``context-management-2025-06-27``; docs "Context editing").

- :class:`ClearToolUses` (``clear_tool_uses_20250919``): once the prompt passes its
  trigger (input tokens, or a number of tool uses), the results of all tool uses but the
  latest ``keep`` are replaced by a placeholder, oldest first, and, when asked, their
  calls' inputs too; tools named in ``exclude`` are never cleared. If clearing everything
  it may clear frees fewer than ``clear_at_least`` tokens, nothing is cleared (a cleared
  prefix costs a new prefill, so it must be worth it).
- :class:`ClearThinking` (``clear_thinking_20251015``): the reasoning of all assistant
  turns but the latest ``keep`` ones is dropped (``keep`` None: all kept, which keeps
  the prefix cache whole).

The client keeps its full history; each request is edited anew, so the same history
edits the same way. Each clearing moves the cleared boundary and so costs a new prefill
from the first result it clears (Anthropic's caveat too): ``clear_at_least`` makes that
worth it. :func:`apply_edits` returns what each edit did, as Anthropic reports it
(``applied_edits``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

from gateway.conversation.form import ToolCall, Turn

PLACEHOLDER = "[This tool result was cleared to save context.]"
DEFAULT_TRIGGER_TOKENS = 100_000  # Anthropic's defaults for clear_tool_uses_20250919
DEFAULT_KEEP_USES = 3


@dataclass(frozen=True)
class ClearToolUses:
    """Clear older tool results (see the module docstring). ``trigger_tokens`` or
    ``trigger_uses`` (tokens of the prompt, tool uses in it) starts it; ``keep`` tool uses
    stay; ``clear_inputs`` True clears every cleared use's input, a set only those tools'."""

    trigger_tokens: Optional[int] = DEFAULT_TRIGGER_TOKENS
    trigger_uses: Optional[int] = None
    keep: int = DEFAULT_KEEP_USES
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: Union[bool, frozenset[str]] = False
    type: str = "clear_tool_uses_20250919"


@dataclass(frozen=True)
class ClearThinking:
    """Drop the reasoning of all but the latest ``keep`` assistant turns that have some
    (None: keep all)."""

    keep: Optional[int] = 1
    type: str = "clear_thinking_20251015"


Edit = Union[ClearToolUses, ClearThinking]


def needs_length(edits: list[Edit]) -> bool:
    """Whether applying ``edits`` needs the unedited prompt's length (an input-token trigger)."""
    return any(isinstance(e, ClearToolUses) and e.trigger_tokens is not None for e in edits)


def apply_edits(turns: list[Turn], edits: list[Edit], prompt_tokens: int,
                count: Callable[[str], int]) -> tuple[list[Turn], list[dict]]:
    """``turns`` with ``edits`` applied in order (new turns; the given ones are not
    changed), and the edits that changed something, as Anthropic's ``applied_edits``
    entries: ``{"type", "cleared_tool_uses" | "cleared_thinking_turns",
    "cleared_input_tokens"}``.

    Args:
        prompt_tokens: the unedited prompt's length (tokens), for input-token triggers.
        count: tokens of a text (the model's tokenizer), for what a clearing frees.
    """
    applied = []
    for edit in edits:
        if isinstance(edit, ClearThinking):
            turns, report = _clear_thinking(turns, edit, count)
        else:
            turns, report = _clear_tool_uses(turns, edit, prompt_tokens, count)
        if report is not None:
            applied.append(report)
    return turns, applied


def _clear_thinking(turns: list[Turn], edit: ClearThinking, count) -> tuple[list[Turn], Optional[dict]]:
    thinking = [i for i, t in enumerate(turns) if t.role == "assistant" and t.reasoning]
    if edit.keep is None or len(thinking) <= edit.keep:
        return turns, None
    cleared = set(thinking[: len(thinking) - edit.keep])
    freed = sum(count(turns[i].reasoning or "") for i in cleared)
    out = [replace(t, reasoning=None) if i in cleared else t for i, t in enumerate(turns)]
    return out, {"type": edit.type, "cleared_thinking_turns": len(cleared), "cleared_input_tokens": freed}


def _clear_tool_uses(turns: list[Turn], edit: ClearToolUses, prompt_tokens: int,
                     count) -> tuple[list[Turn], Optional[dict]]:
    calls = [(i, c) for i, t in enumerate(turns) if t.role == "assistant" for c in t.tool_calls]
    fired = (edit.trigger_tokens is not None and prompt_tokens > edit.trigger_tokens) or \
            (edit.trigger_uses is not None and len(calls) > edit.trigger_uses)
    if not fired:
        return turns, None
    eligible = calls[: max(0, len(calls) - edit.keep)]
    targets = {c.id: c for _, c in eligible if c.name not in edit.exclude}
    results = {i for i, t in enumerate(turns) if t.role == "tool" and t.tool_call_id in targets
               and t.text != PLACEHOLDER}
    placeholder = count(PLACEHOLDER)
    freed = sum(count(turns[i].text) - placeholder for i in results)
    wipe = {cid for cid, c in targets.items() if edit.clear_inputs is True or
            (isinstance(edit.clear_inputs, frozenset) and c.name in edit.clear_inputs)}
    freed += sum(count(targets[cid].arguments) - count("{}") for cid in wipe if targets[cid].arguments != "{}")
    if not results and not wipe or freed < edit.clear_at_least:
        return turns, None
    out = []
    for i, t in enumerate(turns):
        if i in results:
            t = replace(t, text=PLACEHOLDER)
        elif t.role == "assistant" and any(c.id in wipe for c in t.tool_calls):
            t = replace(t, tool_calls=[_wiped(c) if c.id in wipe else c for c in t.tool_calls])
        out.append(t)
    return out, {"type": edit.type, "cleared_tool_uses": len(results), "cleared_input_tokens": max(0, freed)}


def _wiped(call: ToolCall) -> ToolCall:
    """A call with its input cleared (an empty arguments object)."""
    return replace(call, arguments="{}" if call.kind != "custom" else "")
