"""Structured output: ``response_format`` and forced tool calls as one grammar per request.

A conversation's ``output_schema`` (OpenAI's ``response_format``, Anthropic's
``output_config.format``, the Responses API's ``text.format``) constrains the output to
JSON valid for the schema (compact, no free whitespace); a strict one allows no
properties its objects do not name, unless they say so
(:func:`gateway.conversation.schemas.closed_schema`), like every tool's arguments. For a
strict schema, a keyword the grammar engine cannot enforce (``uniqueItems``,
``contains``, ...) is a 400 naming it, never silently ignored; a non-strict one is
enforced as far as the engine can (:mod:`gateway.conversation.schemas`). A
``tool_choice`` of ``required`` or a named function takes precedence, since the output
must then be a call (:func:`gateway.conversation.call_grammar.call_lark`); under ``auto``,
on models whose call tag is a special token, text stays free and a call, once begun,
follows its tool's rules (:func:`gateway.conversation.call_grammar.lazy_call_lark`). The
grammar is compiled into the request's :class:`scheduler.grammar.TokenMask` here, off the
engine thread, so a bad schema is a 400 before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateway.http.errors import APIError
from gateway.conversation.form import Conversation
from gateway.conversation.call_grammar import call_lark, lazy_call_lark
from gateway.conversation.schemas import check_schema, enforced, json_lark, output_fallback
from gateway.conversation.tools import ToolPlan
from scheduler.grammar import GrammarError, Grammars, TokenMask, lark_grammar

# Reasoning tokens a thinking model may spend before a constrained answer, unless the
# request gives a budget of its own (Anthropic's thinking.budget_tokens).
CONSTRAINED_THINKING_BUDGET = 512


@dataclass(frozen=True)
class Thinking:
    """A model about to think: its think tags as Lark expressions, and whether the prompt
    already opened the block."""

    open: str
    close: str
    opened: bool


def output_mask(grammars: Grammars, conv: Conversation, plan: Optional[ToolPlan],
                thinking: Optional[Thinking] = None) -> Optional[TokenMask]:
    """The token mask for a conversation, or None when its output is free. For a model
    that thinks first (``thinking``), the constraint begins after its think block: any
    text up to the end tag (capped by a :class:`scheduler.thinking.ThinkingBudget`), then
    the call or the JSON, as reasoning-aware structured output does elsewhere.

    Raises:
        APIError: 400 for an invalid schema, or one the grammar engine cannot compile (a
            keyword it cannot enforce, such as ``uniqueItems``, is named).
    """
    forced = plan is not None and plan.choice in ("required", "function")
    schema = conv.output_schema
    if not forced and schema is None:
        lazy = lazy_call_lark(plan, grammars)
        return None if lazy is None else _compiled(grammars, lazy, "tools", strict=False)
    param = "tools" if forced else conv.output_param
    if forced:
        body = call_lark(plan, grammars, root="body")
    else:
        check_schema(schema, conv.output_param)
        held = enforced(grammars, schema, conv.output_strict, conv.output_param, output_fallback(schema))
        body = f"body: {json_lark(held, relaxed=not conv.output_strict)}"
    if thinking is None:
        lark = "start: body\n" + body
    elif thinking.opened:
        lark = f"start: reasoning {thinking.close} /\\n{{0,2}}/ body\n{_reasoning(thinking)}\n{body}"
    else:
        lark = (f"start: think? body\nthink: {thinking.open} reasoning {thinking.close} /\\n{{0,2}}/\n"
                f"{_reasoning(thinking)}\n{body}")
    return _compiled(grammars, lark, param, strict=False)


def _reasoning(thinking: Thinking) -> str:
    """The rule ``reasoning``: what may stand between the think tags. With special-token
    tags, any token but the two tags, so that a thinking budget may close the block after
    any token, even one that ends inside a character split over several tokens (a text
    rule would wait for the character to complete, and the budget would leave no token
    allowed); with text tags, any text."""
    ids = [t[2:-2] for t in (thinking.open, thinking.close) if t.startswith("<[") and t.endswith("]>")]
    if len(ids) == 2:
        return f"reasoning: <[^{','.join(ids)}]>*"
    return "reasoning: THINK_TEXT\nTHINK_TEXT: /(.|\\n)*/"


def constrains_answer(conv: Conversation, plan: Optional[ToolPlan]) -> bool:
    """Whether the answer must be a call or JSON (a forced call, an output schema), so a
    thinking model's reasoning gets a budget before it; a grammar that only constrains
    calls the model chooses to make (:func:`lazy_call_lark`) does not."""
    return conv.output_schema is not None or (plan is not None and plan.choice in ("required", "function"))


def _compiled(grammars: Grammars, lark: str, param: str, strict: bool = True) -> TokenMask:
    """The mask of the whole grammar (its schemas were checked one by one, strictly where
    they promise, before it was put together).

    Raises:
        APIError: 400 naming ``param`` when it does not compile.
    """
    try:
        return grammars.mask(lark_grammar(lark), strict)
    except (GrammarError, ValueError, RuntimeError) as e:
        raise APIError(400, f"unsupported JSON Schema: {e}", param=param)
