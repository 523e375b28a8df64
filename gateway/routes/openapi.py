"""The app's OpenAPI 3.1 document (``GET /openapi.json``).

It covers the public routes: every entry of :data:`gateway.routes.table.ROUTES` with a
:class:`~gateway.routes.table.Doc` (request bodies generated from the pydantic models it
names, their ``$defs`` moved to ``components/schemas``; a name two APIs share is prefixed
with the API's, e.g. ``AnthropicTool``). Every error answer is
documented with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (on the
routes whose errors are Anthropic's, ``{"type": "error", "error": {"type", "message"}}``):
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
import re
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Optional, Sequence, Union

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.protocols.responses_schemas import InputItem
from gateway.routes.table import CHUNKS, ROUTES, Route, openapi_path, resolve

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
    return _obj(["id", "object", "created", "model", "choices", *required], id=_STR, object={"const": obj},
                created=_INT, model=_STR, choices={"type": "array", "items": choice}, usage=_ref("Usage"))


_FINISHED, _ANY_FINISH = ["stop", "length"], ["stop", "length", None]
_CHAT_FINISHED, _CHAT_ANY_FINISH = [*_FINISHED, "tool_calls"], [*_ANY_FINISH, "tool_calls"]
_TOOL_CALL = _obj(["id", "type", "function"], id=_STR, type={"const": "function"},
                  function=_obj(["name", "arguments"], name=_STR, arguments=_STR))
_TOOL_CALL_DELTA = _obj(["index"], index=_INT, id=_STR, type={"const": "function"},
                        function=_obj([], name=_STR, arguments=_STR))
_CHAT_LOGPROBS = {"type": ["object", "null"], "properties": {"content": {"type": "array", "items": _LOGPROB}}}
_TEXT_CHOICE = _obj(["index", "text", "finish_reason"], text=_STR, logprobs={"type": ["object", "null"]})
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
    "Model": _obj(["id", "object", "created", "owned_by"], id=_STR, object={"const": "model"}, created=_INT,
                  owned_by=_STR, loaded={"type": "boolean"}, kind={"enum": ["text", "vision", "embedding"]},
                  context_length=_INT, max_output_tokens=_INT),
    "ModelList": _obj(["object", "data"], object={"const": "list"}, data={"type": "array", "items": _ref("Model")}),
    "EmbeddingList": _obj(["object", "data", "model", "usage"], object={"const": "list"}, model=_STR, data={
        "type": "array", "items": _obj(["object", "index", "embedding"], object={"const": "embedding"}, index=_INT,
                                       embedding={"anyOf": [{"type": "array", "items": _NUM}, _STR]})},
        usage=_obj(["prompt_tokens", "total_tokens"], prompt_tokens=_INT, total_tokens=_INT)),
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
    """``input`` of ``ResponsesRequest`` as documented: its items are checked after
    the request (:func:`gateway.protocols.responses_schemas.parse_items`)."""

    input: Union[str, list[InputItem], None] = None


def _body_models() -> list[type[BaseModel]]:
    """The pydantic request models of the documented routes, in table order."""
    return [resolve(r.doc.body) for r in ROUTES if r.doc is not None and isinstance(r.doc.body, str)]


# pydantic names a model two modules define by its module path: named by its API here
_API_PREFIXES = {"openai_schemas": "", "anthropic_schemas": "Anthropic", "responses_schemas": "Responses"}


@lru_cache(maxsize=1)
def request_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies and every model they use, keyed by model name
    (``ChatRequest``, ``MessagesRequest``, ``Message``, ``AnthropicTool``, ...), with ``$ref``
    pointing into ``#/components/schemas``. Cached: treat the result as read-only."""
    models = [*_body_models(), _ResponsesInput]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
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
POST_ERRORS = ("400", "401", "403", "404", "408", "413", "415", "421", "429", "431", "503")
GET_ERRORS = ("401", "421", "431")
OPEN_ERRORS = ("421", "431")
_SECURITY = {"key": SECURED, "open": [], "metrics": [{"bearerAuth": []}, {}]}


def _errors(codes: Sequence[str], body: str) -> dict:
    """Error responses for ``codes`` (strings), each with the error body ``body``
    (OpenAI's ``Error`` or ``AnthropicError``)."""
    out = {}
    for code in codes:
        out[code] = _json(body, ERROR_STATUSES[code])
        if code in _HEADERS:
            out[code]["headers"] = _HEADERS[code]
    return out


def _operation(route: Route) -> dict:
    """The OpenAPI operation of ``route`` from its :class:`Doc`."""
    doc = route.doc
    schema = _ref(doc.result) if isinstance(doc.result, str) else doc.result
    ok = {"description": doc.says, "content": {doc.media: {"schema": schema}}}
    if doc.stream is not None:
        events = f"`{doc.result}Chunk` objects, then `data: [DONE]`" if doc.stream == CHUNKS else doc.stream
        ok["description"] = f"a `{doc.result}` object, or with `stream: true` server-sent events: {events}"
        ok["content"]["text/event-stream"] = {
            "schema": _sse_event(f"{doc.result}Chunk") if doc.stream == CHUNKS else _named_sse_event()}
    op = {"operationId": doc.op, "summary": doc.summary, "security": _SECURITY[doc.security]}
    if doc.tag:
        op["tags"] = [doc.tag]
    params = [{"name": name, "in": "path", "required": True, "schema": _STR}
              for name in re.findall(r"{(\w+)", route.path)]
    params += [{"name": name, "in": "query", "required": False, "schema": s} for name, s in doc.query]
    if params:
        op["parameters"] = params
    if isinstance(doc.body, str):
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": _ref(resolve(doc.body).__name__)}}}
    elif doc.body is not None:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": doc.body}}}
    codes = doc.errors or (POST_ERRORS if isinstance(doc.body, str) else
                           GET_ERRORS if doc.security == "key" else OPEN_ERRORS)
    op["responses"] = {"200": ok, **_errors(codes, "AnthropicError" if route.errors == "anthropic" else "Error")}
    for code, description, name in doc.more:
        op["responses"][code] = _json(name, description)
        if code == "401":
            op["responses"][code]["headers"] = _HEADERS["401"]
    return op


def _restrict(schemas: dict[str, dict], models: Optional[Sequence[str]], max_tokens_limit: Optional[int]) -> None:
    """Write one server's facts into copies of the request schemas (in place)."""
    for model in _body_models():
        props = schemas[model.__name__]["properties"]
        if models and "model" in props:
            props["model"] = {**props["model"], "anyOf": [{"enum": list(models)}, {"type": "null"}]}
        if max_tokens_limit is not None:
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                for branch in props[key].get("anyOf", [props[key]]) if key in props else []:
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_tokens_limit


def openapi_document(models: Optional[Sequence[str]] = None, max_tokens_limit: Optional[int] = None) -> dict:
    """The OpenAPI 3.1 document of the public routes (those of
    :data:`gateway.routes.table.ROUTES` with a :class:`~gateway.routes.table.Doc`), as a
    JSON-ready dict, with their request, response, stream-event and error schemas (see
    the module docstring).

    Args:
        models: names the server answers to; given, ``model`` is an enum of them.
        max_tokens_limit: given, the maximum of ``max_tokens`` / ``max_completion_tokens``.

    Every ``$ref`` points into ``components/schemas`` (no ``$defs``), so generic OpenAPI
    tools resolve it.
    """
    schemas = copy.deepcopy(request_schemas())
    _restrict(schemas, models, max_tokens_limit)
    schemas.update(copy.deepcopy(RESPONSE_SCHEMAS))
    paths: dict[str, dict] = {}
    for route in ROUTES:
        if route.doc is not None:
            for method in route.methods:
                paths.setdefault(openapi_path(route.path), {})[method.lower()] = _operation(route)
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
