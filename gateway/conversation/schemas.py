"""JSON Schemas as the grammar engine holds output to them: closed objects, strict or relaxed.

A schema is either a promise or a description. A **strict** one (``strict: true`` on an
OpenAI tool or format, Anthropic's structured outputs) must be kept exactly, so a keyword
llguidance cannot enforce is a 400 naming it. Any other schema (a non-strict tool, a
non-strict ``response_format``) describes the output to the model: it is enforced as far
as llguidance can (``oneOf`` as ``anyOf``, unimplemented keywords left out,
:data:`scheduler.grammar.JSON_RELAXED`), and where even that does not compile, the
output is held to the nearest shape that does (any JSON object for tool arguments),
never refused, as vLLM and llama.cpp serve such schemas. Every schema must still be a
valid JSON Schema (:func:`check_schema`).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from gateway.http.errors import APIError
from scheduler.grammar import JSON_DEFAULTS, JSON_RELAXED, Grammars, lark_grammar

ANY_OBJECT = {"type": "object"}

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


def json_lark(schema: dict, relaxed: bool = False) -> str:
    """An inline Lark JSON schema: compact JSON valid for ``schema`` (strict options, or
    :data:`JSON_RELAXED`)."""
    return f'%json {json.dumps({**schema, "x-guidance": JSON_RELAXED if relaxed else JSON_DEFAULTS})}'


def enforced(grammars: Grammars, schema: dict, strict: bool, param: str, fallback: dict = ANY_OBJECT) -> dict:
    """The (closed) schema the output is held to, checked on its own with the model's
    grammar engine (remembered per schema, :meth:`Grammars.problem`).

    Strict: ``schema`` closed, or a 400. Not strict: ``schema`` closed when it compiles
    relaxed, else ``fallback`` (what the grammar can promise of that shape).

    Raises:
        APIError: 400 naming ``param`` for a strict schema the engine cannot enforce.
    """
    closed = closed_schema(schema)
    problem = grammars.problem(lark_grammar(f"start: {json_lark(closed, relaxed=not strict)}"), strict)
    if problem is None:
        return closed
    if strict:
        raise APIError(400, f"unsupported JSON Schema for strict output: {problem}", param=param)
    return fallback


def output_fallback(schema: dict) -> dict:
    """What a non-strict output format that cannot be compiled is held to: JSON of the
    schema's top-level type (any JSON value when it names none or several)."""
    kind = schema.get("type")
    return {"type": kind} if isinstance(kind, str) else {}
