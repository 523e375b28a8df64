"""Structured output: ``response_format`` and forced tool calls as one grammar per request.

``{"type": "json_object"}`` constrains the output to one JSON object;
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` to JSON valid
for the schema (compact, no free whitespace). A ``tool_choice`` of ``required`` or a
named function takes precedence, since the output must then be a call
(:func:`gateway.tools.call_grammar`). The grammar is compiled into the request's
:class:`scheduler.grammar.TokenMask` here, off the engine thread, so a bad schema is a
400 before anything is queued.
"""

from __future__ import annotations

from typing import Optional

import jsonschema

from gateway.errors import APIError
from gateway.schemas import ResponseFormat
from gateway.tools import ToolPlan, call_grammar
from scheduler.grammar import GrammarError, Grammars, TokenMask, json_schema_grammar

ANY_OBJECT = {"type": "object"}


def response_schema(fmt: Optional[ResponseFormat]) -> Optional[dict]:
    """The JSON schema ``response_format`` asks for, or None for free text.

    Raises:
        APIError: 400 when ``json_schema`` is missing or its schema is not a valid
            JSON Schema (``param`` names the field).
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    if fmt.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs a json_schema object",
                       param="response_format.json_schema")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else ANY_OBJECT
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"invalid JSON Schema: {e.message}", param="response_format.json_schema.schema")
    return schema


def output_mask(grammars: Grammars, fmt: Optional[ResponseFormat], plan: Optional[ToolPlan]) -> Optional[TokenMask]:
    """The token mask for a chat request, or None when its output is free.

    Raises:
        APIError: 400 for an invalid schema, or one the grammar engine cannot compile.
    """
    schema = response_schema(fmt)
    forced = plan is not None and plan.choice in ("required", "function")
    if not forced and schema is None:
        return None
    param = "tools" if forced else "response_format.json_schema.schema"
    try:
        return grammars.mask(call_grammar(plan, grammars.lark_literal) if forced else json_schema_grammar(schema))
    except (GrammarError, ValueError, RuntimeError) as e:
        raise APIError(400, f"unsupported JSON Schema: {e}", param=param)
