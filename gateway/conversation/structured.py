"""Structured output: ``response_format`` and forced tool calls as one grammar per request.

A conversation's ``output_schema`` (OpenAI's ``response_format``, Anthropic's
``output_config.format``, the Responses API's ``text.format``) constrains the output to
JSON valid for the schema (compact, no free whitespace). A ``tool_choice`` of ``required`` or a
named function takes precedence, since the output must then be a call
(:func:`gateway.conversation.tools.call_grammar`). The grammar is compiled into the request's
:class:`scheduler.grammar.TokenMask` here, off the engine thread, so a bad schema is a
400 before anything is queued.
"""

from __future__ import annotations

from typing import Optional

from gateway.http.errors import APIError
from gateway.conversation.form import Conversation
from gateway.conversation.tools import ToolPlan, call_grammar, check_schema
from scheduler.grammar import GrammarError, Grammars, TokenMask, json_schema_grammar


def output_mask(grammars: Grammars, conv: Conversation, plan: Optional[ToolPlan]) -> Optional[TokenMask]:
    """The token mask for a conversation, or None when its output is free.

    Raises:
        APIError: 400 for an invalid schema, or one the grammar engine cannot compile.
    """
    forced = plan is not None and plan.choice in ("required", "function")
    schema = conv.output_schema
    if not forced and schema is None:
        return None
    if not forced:
        check_schema(schema, conv.output_param)
    param = "tools" if forced else conv.output_param
    try:
        return grammars.mask(call_grammar(plan, grammars.lark_literal) if forced else json_schema_grammar(schema))
    except (GrammarError, ValueError, RuntimeError) as e:
        raise APIError(400, f"unsupported JSON Schema: {e}", param=param)
