"""The app's OpenAPI 3.1 document (``GET /openapi.json``).

It covers the public routes: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages``, ``POST /v1/messages/count_tokens`` and ``POST /v1/responses``
(request bodies generated from the pydantic models in :mod:`gateway.protocols`, their
``$defs`` moved to ``components/schemas``; a name two APIs share is prefixed with the
API's, e.g. ``AnthropicTool``), ``GET``/``DELETE /v1/responses/{response_id}``,
``GET /v1/models``, ``GET /v1/usage``, ``POST /admin/cache/flush`` (admin keys),
``GET /health``, ``GET /metrics`` and ``GET /openapi.json`` itself. Every error answer is
documented with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (on the
``/v1/messages`` routes Anthropic's, ``{"type": "error", "error": {"type", "message"}}``):
400 (bad JSON or field), 401 / 403 (missing / refused API key), 404 (unknown model), 408
(body too slow), 413 (body too large), 415 (body not sent as ``application/json``), 421
(Host not allowed), 429 (rate limited), 431 (headers too large) and 503 (model loading,
engine stopped, queue full). The API key goes in ``Authorization: Bearer <key>`` or
``x-api-key: <key>``; a server started without keys accepts anonymous requests, which the
document says with an empty security requirement. ``/health``, ``/metrics`` and
``/openapi.json`` need no key (``/metrics`` needs the metrics key when the server has
one). Streams are documented per event (OpenAPI 3.1's reading of a ``text/event-stream``
schema): ``data`` holds a JSON chunk, an error body, or ``[DONE]``; the Messages and
Responses streams are named events whose ``data`` is a JSON object with a ``type``.

Served from a running app, the document also states that server's facts: the model names
it answers to (``model`` enum) and ``--max-tokens-limit`` (maximum of ``max_tokens`` and
its other names).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Optional, Sequence, Union

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.protocols.anthropic_schemas import CountTokensRequest, MessagesRequest
from gateway.protocols.openai_schemas import ChatRequest, CompletionRequest
from gateway.protocols.responses_schemas import InputItem, ResponsesRequest

REF = "#/components/schemas/{model}"
try:
    VERSION = version("mlx-gateway")
except PackageNotFoundError:  # running from a source tree
    VERSION = "0.0.0"
SECURED = [{"bearerAuth": []}, {"apiKeyHeader": []}, {}]  # {}: servers without keys

ERROR_STATUSES = {
    "400": "malformed JSON, a wrong field (`param` names it), `max_tokens` over the limit, "
           "or a prompt longer than the model's context",
    "401": "no API key, or an unknown one",
    "403": "the API key may not use this model or route",
    "404": "unknown model (`param` is `model`)",
    "408": "the request body did not arrive within the client timeout",
    "413": "request body over `--max-body-bytes`",
    "415": "the body is not sent with `Content-Type: application/json`",
    "421": "the Host header names no name of this server (DNS rebinding protection; `--allowed-hosts`)",
    "429": "rate limited; retry after `Retry-After` seconds",
    "431": "too many request headers, or too many bytes of them",
    "503": "model still loading, engine stopped, or queue full (`Retry-After` where waiting helps)",
}


def _obj(required: Sequence[str], **props: dict) -> dict:
    return {"type": "object", "required": list(required), "properties": props}


_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
_LOGPROB = _obj(["token", "logprob"], token=_STR, logprob=_NUM,
                bytes={"type": "array", "items": _INT}, top_logprobs={"type": "array"})


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def _completion(obj: str, required: Sequence[str], choice: dict, finish: list) -> dict:
    """An OpenAI completion object (or stream chunk) with ``choices`` items ``choice``."""
    choice = {**choice, "properties": {**choice["properties"], "index": _INT, "finish_reason": {"enum": finish}}}
    return _obj(["id", "object", "created", "model", "choices", *required],
                id=_STR, object={"const": obj}, created=_INT, model=_STR,
                choices={"type": "array", "items": choice}, usage=_ref("Usage"))


_FINISHED, _ANY_FINISH = ["stop", "length"], ["stop", "length", None]
_CHAT_FINISHED, _CHAT_ANY_FINISH = [*_FINISHED, "tool_calls"], [*_ANY_FINISH, "tool_calls"]
_TOOL_CALL = _obj(["id", "type", "function"], id=_STR, type={"const": "function"},
                  function=_obj(["name", "arguments"], name=_STR, arguments=_STR))
_TOOL_CALL_DELTA = _obj(["index"], index=_INT, id=_STR, type={"const": "function"},
                        function=_obj([], name=_STR, arguments=_STR))
_CHAT_LOGPROBS = {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": _LOGPROB}}}
_TEXT_CHOICE = _obj(["index", "text", "finish_reason"], text=_STR, logprobs={"type": ["object", "null"]})
_OBJECTS = {"type": "array", "items": {"type": "object"}}
_EVENT = _obj(["type"], type=_STR)  # a Messages or Responses stream event
_NULLABLE_OBJ = {"type": ["object", "null"]}

# Response and error bodies (JSON Schema 2020-12, as OpenAPI 3.1 uses).
RESPONSE_SCHEMAS: dict[str, dict] = {
    "Error": _obj(["error"], error=_obj(
        ["message", "type", "param", "code"],
        message=_STR, type=_STR, param=_NULLABLE_STR, code=_NULLABLE_STR)),
    "Usage": _obj(["prompt_tokens", "completion_tokens", "total_tokens"],
                  prompt_tokens=_INT, completion_tokens=_INT, total_tokens=_INT,
                  prompt_tokens_details=_obj(["cached_tokens"], cached_tokens=_INT)),
    "ChatCompletion": _completion("chat.completion", ["usage"], _obj(
        ["index", "message", "finish_reason"], logprobs=_CHAT_LOGPROBS,
        message=_obj(["role", "content"], role={"const": "assistant"}, content=_NULLABLE_STR,
                     reasoning_content=_STR, tool_calls={"type": "array", "items": _TOOL_CALL}),
    ), _CHAT_FINISHED),
    "ChatCompletionChunk": _completion("chat.completion.chunk", [], _obj(
        ["index", "delta", "finish_reason"], logprobs=_CHAT_LOGPROBS,
        delta=_obj([], role={"const": "assistant"}, content=_STR, reasoning_content=_STR,
                   tool_calls={"type": "array", "items": _TOOL_CALL_DELTA}),
    ), _CHAT_ANY_FINISH),
    "TextCompletion": _completion("text_completion", ["usage"], _TEXT_CHOICE, _FINISHED),
    "TextCompletionChunk": _completion("text_completion", [], _TEXT_CHOICE, _ANY_FINISH),
    "ModelList": _obj(["object", "data"], object={"const": "list"}, data={
        "type": "array", "items": _obj(["id", "object", "created", "owned_by"], id=_STR,
                                       object={"const": "model"}, created=_INT, owned_by=_STR)}),
    "AnthropicError": _obj(["type", "error"], type={"const": "error"},
                           error=_obj(["type", "message"], type=_STR, message=_STR)),
    "AnthropicMessage": _obj(
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        id=_STR, type={"const": "message"}, role={"const": "assistant"}, model=_STR,
        content={"type": "array", "items": _EVENT}, stop_reason=_NULLABLE_STR, stop_sequence=_NULLABLE_STR,
        usage=_obj(["input_tokens", "output_tokens"], input_tokens=_INT, output_tokens=_INT,
                   cache_creation_input_tokens=_INT, cache_read_input_tokens=_INT)),
    "AnthropicTokenCount": _obj(["input_tokens"], input_tokens=_INT),
    "Response": _obj(
        ["id", "object", "created_at", "status", "model", "output"],
        id=_STR, object={"const": "response"}, created_at=_INT,
        status={"enum": ["completed", "incomplete", "in_progress", "failed"]}, model=_STR,
        output={"type": "array", "items": _EVENT}, error=_NULLABLE_OBJ, incomplete_details=_NULLABLE_OBJ,
        usage={"type": ["object", "null"], "properties": {"input_tokens": _INT, "output_tokens": _INT,
                                                         "total_tokens": _INT}}),
    "ResponseDeleted": _obj(["id", "object", "deleted"], id=_STR, object={"const": "response"},
                            deleted={"const": True}),
    "InputItemList": _obj(["object", "data", "first_id", "last_id", "has_more"], object={"const": "list"},
                          data={"type": "array", "items": _EVENT}, first_id=_NULLABLE_STR,
                          last_id=_NULLABLE_STR, has_more={"type": "boolean"}),
    "Health": _obj(["status"], status={"enum": ["ok", "loading", "error", "dead"]},
                   model=_STR, running=_INT, waiting=_INT, detail=_NULLABLE_STR),
}


def _sse_event(chunk: str) -> dict:
    """Schema of one server-sent event (OpenAPI 3.1 puts it under ``schema``): ``data`` is a
    JSON ``chunk`` object, an error body (the request failed after the stream began), or
    the final ``[DONE]``."""
    payload = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}
    return _obj(["data"], event=_STR, id=_STR, data={"anyOf": [{"const": "[DONE]"}, {"type": "string", **payload}]})


def _named_sse_event() -> dict:
    """Schema of one event of a Messages or Responses stream: a named event whose
    ``data`` is a JSON object with a ``type`` (``error``, ``response.failed`` included)."""
    payload = {"contentMediaType": "application/json", "contentSchema": _EVENT}
    return _obj(["event", "data"], event=_STR, data={"type": "string", **payload})


SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"},
    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key",
                     "description": "the same API key in an x-api-key header"},
}


class _ResponsesInput(BaseModel):
    """``input`` of :class:`ResponsesRequest` as documented: its items are checked after
    the request (:func:`gateway.protocols.responses_schemas.parse_items`)."""

    input: Union[str, list[InputItem], None] = None


REQUEST_MODELS = (ChatRequest, CompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest,
                  _ResponsesInput)
# pydantic names a model two modules define by its module path: named by its API here
_API_PREFIXES = {"openai_schemas": "", "anthropic_schemas": "Anthropic", "responses_schemas": "Responses"}


@lru_cache(maxsize=1)
def request_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies and every model they use, keyed by model name
    (``ChatRequest``, ``MessagesRequest``, ``Message``, ``AnthropicTool``, ...), with ``$ref``
    pointing into ``#/components/schemas``. Cached: treat the result as read-only."""
    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=REF)
    names = {}
    for name in top["$defs"]:
        *_, module, model = name.split("__") if "__" in name else ("", "", name)
        names[name] = _API_PREFIXES.get(module, "") + model
    text = json.dumps({names[name]: schema for name, schema in top["$defs"].items()})
    for old, new in names.items():
        if old != new:
            text = text.replace(f'"{REF.format(model=old)}"', f'"{REF.format(model=new)}"')
    defs = json.loads(text)
    defs["ResponsesRequest"]["properties"]["input"] = defs.pop("_ResponsesInput")["properties"]["input"]
    return defs


def _json(schema_name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema_name)}}}


_HEADERS = {
    "401": {"WWW-Authenticate": {"description": "`Bearer`", "schema": _STR}},
    "429": {"Retry-After": {"description": "seconds to wait before retrying", "schema": _INT}},
    "503": {"Retry-After": {"description": "seconds to wait before retrying (not always sent)",
                            "schema": _INT}},
}


def _errors(*codes: str, body: str = "Error") -> dict:
    """Error responses for ``codes`` (strings), each with the error body ``body``
    (OpenAI's ``Error`` or ``AnthropicError``)."""
    out = {}
    for code in codes:
        out[code] = _json(body, ERROR_STATUSES[code])
        if code in _HEADERS:
            out[code]["headers"] = _HEADERS[code]
    return out


POST_ERRORS = ("400", "401", "403", "404", "408", "413", "415", "421", "429", "431", "503")
GET_ERRORS = ("401", "421", "431")


def _post_op(op_id: str, summary: str, body: str, ok: dict, error_body: str = "Error") -> dict:
    return {
        "operationId": op_id,
        "summary": summary,
        "security": SECURED,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {"200": ok, **_errors(*POST_ERRORS, body=error_body)},
    }


def _completion_op(op_id: str, summary: str, body: str, result: str) -> dict:
    return _post_op(op_id, summary, body, {
        "description": f"a `{result}` object, or with `stream: true` server-sent events: "
                       f"`{result}Chunk` objects, then `data: [DONE]`",
        "content": {"application/json": {"schema": _ref(result)},
                    "text/event-stream": {"schema": _sse_event(f"{result}Chunk")}}})


def _events_op(op_id: str, summary: str, body: str, result: str, events: str, error_body: str = "Error") -> dict:
    return _post_op(op_id, summary, body, {
        "description": f"a `{result}` object, or with `stream: true` server-sent events: {events}",
        "content": {"application/json": {"schema": _ref(result)},
                    "text/event-stream": {"schema": _named_sse_event()}}}, error_body)


def _response_op(op_id: str, summary: str, result: str, description: str) -> dict:
    return {"operationId": op_id, "summary": summary, "security": SECURED,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": _STR}],
            "responses": {"200": _json(result, description),
                          "404": _json("Error", "no response with this id for this key"), **_errors(*GET_ERRORS)}}


def _input_items_op() -> dict:
    op = _response_op("listInputItems", "The input items of a stored response", "InputItemList",
                      "a page of the items the response was generated from (its chain's, then its own input)")
    op["parameters"] += [
        {"name": "after", "in": "query", "required": False, "schema": _STR},
        {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1,
                                                                        "maximum": 100}},
        {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}}]
    op["responses"]["400"] = _json("Error", "a query parameter out of range, or an unknown `after`")
    return op


def _restrict(schemas: dict[str, dict], models: Optional[Sequence[str]], max_tokens_limit: Optional[int]) -> None:
    """Write one server's facts into copies of the request schemas (in place)."""
    for name in ("ChatRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest"):
        props = schemas[name]["properties"]
        if models:
            props["model"] = {**props["model"], "anyOf": [{"enum": list(models)}, {"type": "null"}]}
        if max_tokens_limit is not None:
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                for branch in props[key].get("anyOf", [props[key]]) if key in props else []:
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_tokens_limit


def openapi_document(models: Optional[Sequence[str]] = None, max_tokens_limit: Optional[int] = None) -> dict:
    """The OpenAPI 3.1 document of the public routes, as a JSON-ready dict: the POST
    routes of the three APIs with their request, response, stream-event and error schemas,
    and ``/v1/models``, ``/health``, ``/metrics``, ``/openapi.json`` (see the module docstring).

    Args:
        models: names the server answers to; given, ``model`` is an enum of them.
        max_tokens_limit: given, the maximum of ``max_tokens`` / ``max_completion_tokens``.

    Every ``$ref`` points into ``components/schemas`` (no ``$defs``), so generic OpenAPI
    tools resolve it.
    """
    schemas = copy.deepcopy(request_schemas())
    _restrict(schemas, models, max_tokens_limit)
    schemas.update(copy.deepcopy(RESPONSE_SCHEMAS))
    open_get = {"security": []}
    paths = {
        "/v1/chat/completions": {"post": _completion_op(
            "createChatCompletion", "Chat completion", "ChatRequest", "ChatCompletion")},
        "/v1/completions": {"post": _completion_op(
            "createCompletion", "Text completion", "CompletionRequest", "TextCompletion")},
        "/v1/messages": {"post": _events_op(
            "createMessage", "Anthropic Messages", "MessagesRequest", "AnthropicMessage",
            "`message_start`, `content_block_start`/`delta`/`stop`, `ping`, `message_delta`, `message_stop` "
            "(`error` when the request fails after the stream began)", "AnthropicError")},
        "/v1/messages/count_tokens": {"post": _post_op(
            "countMessageTokens", "Prompt tokens of a Messages request (nothing is generated)",
            "CountTokensRequest", _json("AnthropicTokenCount", "`{input_tokens}`"), "AnthropicError")},
        "/v1/responses": {"post": _events_op(
            "createResponse", "OpenAI Responses", "ResponsesRequest", "Response",
            "`response.created`, `response.in_progress`, item and part events, then `response.completed` "
            "or `response.incomplete` (`response.failed` when the request fails after the stream began)")},
        "/v1/responses/{response_id}": {
            "get": _response_op("getResponse", "A stored response", "Response", "the stored response object"),
            "delete": _response_op("deleteResponse", "Delete a stored response", "ResponseDeleted",
                                   "`{id, object: response, deleted: true}`")},
        "/v1/responses/{response_id}/input_items": {"get": _input_items_op()},
        "/v1/models": {"get": {
            "operationId": "listModels", "summary": "The served model names", "security": SECURED,
            "responses": {"200": _json("ModelList", "the model names this server answers to"),
                          **_errors(*GET_ERRORS)}}},
        "/v1/usage": {"get": {
            "operationId": "usage", "summary": "The caller's usage; every tenant's for an admin key",
            "security": SECURED,
            "responses": {"200": {"description": "`{object: usage, tenant, window: {start, seconds, requests, "
                                                 "prompt_tokens, cached_tokens, completion_tokens}, total: {since, "
                                                 "...}}`, or for an admin key `{object: list, data: [...]}`",
                                  "content": {"application/json": {"schema": {"type": "object"}}}},
                          **_errors(*GET_ERRORS)}}},
        "/admin/cache/flush": {"post": {
            "operationId": "flushCache", "summary": "Drop a cache group's unleased prefix-cache snapshots",
            "security": SECURED,
            "requestBody": {"required": False, "content": {"application/json": {"schema": _obj(
                [], cache_group={"type": ["string", "null"], "description": "absent or null: every group"})}}},
            "responses": {"200": {"description": "`{object: cache.flush, cache_group, dropped_snapshots}`",
                                  "content": {"application/json": {"schema": _obj(
                                      ["object", "cache_group", "dropped_snapshots"], object=_STR,
                                      cache_group=_NULLABLE_STR, dropped_snapshots=_INT)}}},
                          **_errors("400", "401", "403", "408", "413", "415", "421", "431", "503")}}},
        "/health": {"get": {
            "operationId": "health", "summary": "Liveness and queue sizes", **open_get,
            "responses": {"200": _json("Health", "the engine is running"),
                          "503": _json("Health", "the model is loading, failed to load, or the engine stopped"),
                          **_errors("421", "431")}}},
        "/metrics": {"get": {
            "operationId": "metrics", "summary": "Prometheus metrics (with the server's metrics key, if it "
                                                 "has one, as `Authorization: Bearer`)",
            "security": [{"bearerAuth": []}, {}],
            "responses": {"200": {"description": "Prometheus text exposition format",
                                  "content": {"text/plain": {"schema": _STR}}},
                          "401": {**_json("Error", "the server has a metrics key and it was not sent"),
                                  "headers": _HEADERS["401"]}, **_errors("421", "431")}}},
        "/openapi.json": {"get": {
            "operationId": "openapi", "summary": "This document", **open_get,
            "responses": {"200": {"description": "the OpenAPI 3.1 document",
                                  "content": {"application/json": {"schema": {"type": "object"}}}},
                          **_errors("421", "431")}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlx-gateway", "version": VERSION,
                 "description": "OpenAI-compatible serving gateway for MLX models."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": SECURITY_SCHEMES},
    }


async def openapi_json(request: Request) -> Response:
    """``GET /openapi.json``: :func:`openapi_document` with this server's model names and
    aliases and its largest ``max_tokens`` limit (from ``request.app.state.front`` when the
    app has one)."""
    front = getattr(request.app.state, "front", None)
    if front is None:
        return JSONResponse(openapi_document())
    specs = [s.spec for s in front.models.slots]
    return JSONResponse(openapi_document([n for spec in specs for n in spec.names],
                                         max(spec.max_tokens_limit for spec in specs)))
