"""Every route the gateway serves, declared once: its handler, how ``openapi.json``
documents it, the shape of its errors, and how the cluster front
(``deploy/cluster/front.py``) sends it.

:mod:`gateway.routes.app` serves :data:`ROUTES`, :mod:`gateway.routes.openapi` documents
the entries with a :class:`Doc`, and the cluster front routes each path by its
:attr:`Route.cluster` rule. Handlers and request models are named ``"module:attribute"``
and imported by the app, so that the front reads this table without loading the gateway.
A new protocol is one module under :mod:`gateway.protocols` plus its entries here.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Optional, Union

# How the cluster front sends a route (deploy/cluster/front.py; front_rules.py says why):
ROUTER = "router"  # to SGLang's router byte for byte; to a replica by affinity when the router would drop
# what the request uses (front_rules.around_router: CORS, a latency class, a session key)
REPLICA = "replica"  # to one replica by the conversation's affinity key (front_rules.affinity_key); a
# previous_response_id to the replica that made it
STORED = "stored"  # to the replica that made the stored response {response_id}, else each replica in turn
ANY = "any"  # to one replica, by the caller's key (every replica answers alike)
EVERY = "every"  # to every replica: /v1/usage's counts added up, other answers listed
FRONT = "front"  # answered by the front itself (its own /health)

CHUNKS = "chunks"  # Doc.stream: OpenAI's stream, `{result}Chunk` objects then `data: [DONE]`


@dataclass(frozen=True)
class Doc:
    """How ``openapi.json`` documents one operation (:mod:`gateway.routes.openapi`).

    Args:
        op: the ``operationId``.
        summary: one line.
        says: what a 200 answer holds.
        result: the 200 body: a schema name in ``components/schemas``, or an inline schema.
        body: the request body: ``"module:Model"`` (a pydantic model, required), an inline
            schema (optional), or None.
        stream: None; :data:`CHUNKS`; or the named events of a ``stream: true`` answer
            (``says`` is then written from ``result`` and these).
        security: ``key`` (an API key, or none on a server without keys), ``open``, or
            ``metrics`` (the server's metrics key, if it has one).
        errors: the error statuses documented; None: those of a request with a body, of
            a keyed ``GET``, or of an open route.
        more: more answers, ``(status, description, schema name)`` each.
        query: query parameters, ``(name, schema)`` each.
        media: the 200 body's media type.
        tag: the operation's tag, if any.
    """

    op: str
    summary: str
    says: str
    result: Union[str, dict]
    body: Union[str, dict, None] = None
    stream: Optional[str] = None
    security: str = "key"
    errors: Optional[tuple[str, ...]] = None
    more: tuple[tuple[str, str, str], ...] = ()
    query: tuple[tuple[str, dict], ...] = ()
    media: str = "application/json"
    tag: Optional[str] = None


@dataclass(frozen=True)
class Route:
    """One served route.

    Args:
        methods: HTTP methods (``HEAD`` named where it is served on its own; Starlette
            answers ``HEAD`` for every ``GET`` too).
        path: Starlette's path, converters included (``{model_id:path}``).
        handler: ``"module:function"``, the Starlette endpoint.
        cluster: how the cluster front sends it (:data:`ROUTER`, :data:`REPLICA`,
            :data:`STORED`, :data:`ANY`, :data:`EVERY`, :data:`FRONT`).
        doc: its OpenAPI operation; None: not in ``openapi.json``.
        errors: the shape of its error bodies, ``openai``, ``anthropic`` or ``ollama``
            (:meth:`gateway.http.errors.APIError.response`).
    """

    methods: tuple[str, ...]
    path: str
    handler: str
    cluster: str
    doc: Optional[Doc] = None
    errors: str = "openai"


P, S, R, A = "gateway.protocols.", "gateway.routes.service:", "gateway.protocols.responses:", "gateway.routes.admin:"
RT = "gateway.routes."
_RESPONSE_404 = (("404", "no response with this id for this key", "Error"),)

ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/v1/chat/completions", P + "openai_chat:chat_completions", ROUTER, Doc(
        "createChatCompletion", "Chat completion", "", "ChatCompletion", P + "openai_schemas:ChatRequest", CHUNKS)),
    Route(("POST",), "/v1/completions", P + "openai_completions:completions", ROUTER, Doc(
        "createCompletion", "Text completion", "", "TextCompletion", P + "openai_schemas:CompletionRequest",
        CHUNKS)),
    Route(("POST",), "/v1/embeddings", P + "embeddings:embeddings", ROUTER, Doc(
        "createEmbedding", "Vectors of texts or token sequences, from an embedding model",
        "one vector per input (a list of numbers, or base64 with `encoding_format: base64`)", "EmbeddingList",
        P + "embeddings:EmbeddingsRequest")),
    Route(("POST",), "/v1/responses", R + "create_response", REPLICA, Doc(
        "createResponse", "OpenAI Responses", "", "Response", P + "responses_schemas:ResponsesRequest",
        "`response.created`, `response.in_progress`, item and part events, then `response.completed` or "
        "`response.incomplete` (`response.failed` when the request fails after the stream began)")),
    Route(("GET",), "/v1/responses/{response_id}", R + "retrieve_response", STORED, Doc(
        "getResponse", "A stored response", "the stored response object", "Response",
        more=_RESPONSE_404)),
    Route(("DELETE",), "/v1/responses/{response_id}", R + "delete_response", STORED, Doc(
        "deleteResponse", "Delete a stored response", "`{id, object: response, deleted: true}`", "ResponseDeleted",
        more=_RESPONSE_404)),
    Route(("GET",), "/v1/responses/{response_id}/input_items", R + "list_input_items", STORED, Doc(
        "listInputItems", "The input items of a stored response",
        "a page of the items the response was generated from (its chain's, then its own input)", "InputItemList",
        more=(*_RESPONSE_404, ("400", "a query parameter out of range, or an unknown `after`", "Error")),
        query=(("after", {"type": "string"}), ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
               ("order", {"enum": ["asc", "desc"]})))),
    Route(("POST",), "/v1/messages", P + "anthropic:messages", REPLICA, Doc(
        "createMessage", "Anthropic Messages", "", "AnthropicMessage", P + "anthropic_schemas:MessagesRequest",
        "`message_start`, `content_block_start`/`delta`/`stop`, `ping`, `message_delta`, `message_stop` "
        "(`error` when the request fails after the stream began)"), errors="anthropic"),
    Route(("POST",), "/v1/messages/count_tokens", P + "anthropic:count_tokens", REPLICA, Doc(
        "countMessageTokens", "Prompt tokens of a Messages request (nothing is generated)", "`{input_tokens}`",
        "AnthropicTokenCount", P + "anthropic_schemas:CountTokensRequest"), errors="anthropic"),
    Route(("GET",), "/v1/models", S + "models", ANY, Doc(
        "listModels", "The served model names", "the model names this server answers to", "ModelList")),
    Route(("GET",), "/v1/models/{model_id:path}", S + "model", ANY, Doc(
        "getModel", "One served model", "the model object", "Model",
        more=(("404", "no model of this name for this key", "Error"),))),
    Route(("GET",), "/v1/usage", S + "usage_report", EVERY, Doc(
        "usage", "The caller's usage; every tenant's for an admin key",
        "`{object: usage, tenant, window: {start, seconds, requests, prompt_tokens, cached_tokens, "
        "completion_tokens}, total: {since, ...}}`, or for an admin key `{object: list, data: [...]}`",
        {"type": "object"})),
    Route(("GET",), "/v1/cache/explain", S + "cache_explain", EVERY, Doc(
        "explainCache", "Why the last requests' prompts left the prefix cache where they did",
        "`{object: list, data: [{request_id, tenant, model, cause, at, prompt_tokens, cached_tokens, part, message, "
        "role, detail, evicted_at, before, prompt, cached}]}` newest first (the caller's tenant's; every tenant's "
        "for an admin key); with `request_id`, that one request's object (`object: cache.explanation`)",
        {"type": "object"}, more=(("404", "no explanation kept for this request id and key", "Error"),),
        query=(("request_id", {"type": "string"}), ("limit", {"type": "integer", "minimum": 1, "maximum": 500})))),
    Route(("POST",), "/admin/cache/flush", A + "flush_cache", EVERY, Doc(
        "flushCache", "Drop a cache group's unleased prefix-cache snapshots",
        "`{object: cache.flush, cache_group, dropped_snapshots}`",
        {"type": "object", "required": ["object", "cache_group", "dropped_snapshots"], "properties": {
            "object": {"type": "string"}, "cache_group": {"type": ["string", "null"]},
            "dropped_snapshots": {"type": "integer"}}},
        {"type": "object", "required": [], "properties": {"cache_group": {
            "type": ["string", "null"], "description": "absent or null: every group"}}},
        errors=("400", "401", "403", "408", "413", "415", "421", "431", "503"))),
    Route(("GET",), "/admin/models", A + "list_models", EVERY),
    Route(("POST",), "/admin/models/{name:path}/load", A + "load_model", EVERY),
    Route(("POST",), "/admin/models/{name:path}/unload", A + "unload_model", EVERY),
    Route(("POST",), "/v1/load_lora_adapter", RT + "lora:load_lora_adapter", EVERY, Doc(
        "loadLoraAdapter", "Load a LoRA adapter onto its base model (admin keys; vLLM's interface)",
        "vLLM's text: the adapter was added", {"type": "string"},
        {"type": "object", "required": ["lora_name", "lora_path"], "properties": {
            "lora_name": {"type": "string"}, "lora_path": {"type": "string"},
            "base_model_name": {"type": "string"}}},
        errors=("400", "401", "403", "404", "408", "413", "415", "421", "431", "503"), media="text/plain")),
    Route(("POST",), "/v1/unload_lora_adapter", RT + "lora:unload_lora_adapter", EVERY, Doc(
        "unloadLoraAdapter", "Unload a LoRA adapter (admin keys; vLLM's interface)",
        "vLLM's text: the adapter was removed", {"type": "string"},
        {"type": "object", "required": ["lora_name"], "properties": {"lora_name": {"type": "string"}}},
        errors=("400", "401", "403", "404", "408", "413", "415", "421", "431", "503"), media="text/plain")),
    Route(("GET",), "/health", S + "health", FRONT, Doc(
        "health", "Liveness and queue sizes", "the engine is running", "Health", security="open",
        more=(("503", "the model is loading, failed to load, or the engine stopped", "Health"),))),
    Route(("GET",), "/metrics", S + "metrics", ROUTER, Doc(
        "metrics", "Prometheus metrics (with the server's metrics key, if it has one, as `Authorization: Bearer`)",
        "Prometheus text exposition format", {"type": "string"}, security="metrics", media="text/plain",
        more=(("401", "the server has a metrics key and it was not sent", "Error"),))),
    Route(("GET",), "/server_info", S + "server_info", ROUTER),
    Route(("GET",), "/get_server_info", S + "server_info", ROUTER),
    Route(("GET",), "/model_info", S + "model_info", ROUTER),
    Route(("GET",), "/get_model_info", S + "model_info", ROUTER),
    Route(("GET",), "/get_load", S + "get_load", ROUTER),
    Route(("GET",), "/openapi.json", "gateway.routes.openapi:openapi_json", ROUTER, Doc(
        "openapi", "This document", "the OpenAPI 3.1 document", {"type": "object"}, security="open")),
    # Ollama's REST API (docs/ollama.md): its errors are {"error": "..."}; behind the cluster
    # front a conversation goes by affinity, the rest to one replica (a pull, copy or create
    # acts on that replica alone).
    Route(("GET",), "/", RT + "ollama_models:root", ANY, errors="ollama"),
    Route(("POST",), "/api/chat", P + "ollama_chat:chat", REPLICA, errors="ollama"),
    Route(("POST",), "/api/generate", P + "ollama_chat:generate", REPLICA, errors="ollama"),
    Route(("POST",), "/api/embed", P + "ollama_embed:embed_route", ANY, errors="ollama"),
    Route(("POST",), "/api/embeddings", P + "ollama_embed:embeddings_route", ANY, errors="ollama"),
    Route(("GET",), "/api/tags", RT + "ollama_models:tags", ANY, errors="ollama"),
    Route(("POST",), "/api/show", RT + "ollama_models:show", ANY, errors="ollama"),
    Route(("GET",), "/api/ps", RT + "ollama_models:ps", ANY, errors="ollama"),
    Route(("GET",), "/api/version", RT + "ollama_models:version", ANY, errors="ollama"),
    Route(("POST",), "/api/pull", RT + "ollama_models:pull", ANY, errors="ollama"),
    Route(("POST",), "/api/push", RT + "ollama_models:push", ANY, errors="ollama"),
    Route(("POST",), "/api/copy", RT + "ollama_models:copy", ANY, errors="ollama"),
    Route(("POST",), "/api/create", RT + "ollama_models:create", ANY, errors="ollama"),
    Route(("DELETE",), "/api/delete", RT + "ollama_models:delete", ANY, errors="ollama"),
)


def resolve(ref: str):
    """The attribute ``"module:name"`` names (a handler, a request model), imported.

    Raises:
        ImportError, AttributeError: there is none.
    """
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _prefix(path: str) -> str:
    return path.split("{", 1)[0].rstrip("/")


# Path families whose unserved paths answer in their API's error shape too.
FAMILIES = (("/api/", "ollama"),)


def error_style(path: str) -> str:
    """The error shape of ``path`` (served or not): that of the route it is; else of the
    route whose path, up to its first parameter, or the :data:`FAMILIES` prefix, is the
    longest that ``path`` starts with (then a ``/``); ``openai`` when none is."""
    best, style = -1, "openai"
    for route in ROUTES:
        if path == route.path:
            return route.errors
        prefix = _prefix(route.path)
        if prefix and len(prefix) > best and (path == prefix or path.startswith(prefix + "/")):
            best, style = len(prefix), route.errors
    for prefix, family in FAMILIES:
        if len(prefix) > best and path.startswith(prefix):
            best, style = len(prefix), family
    return style


def _pattern(path: str) -> re.Pattern:
    return re.compile(re.sub(r"{\w+(:\w+)?}", lambda m: ".+" if m.group(1) == ":path" else "[^/]+", path) + "$")


_PATTERNS = [(_pattern(r.path), r.path) for r in ROUTES]


def metrics_label(path: str) -> str:
    """The ``endpoint`` label of a request on ``path``: its route's path, any parameters
    (and what follows them) as one ``{id}`` (``/v1/responses/{id}``); ``other`` when no
    route serves ``path``."""
    route = next((p for pattern, p in _PATTERNS if pattern.match(path)), None)
    if route is None:
        return "other"
    return route if "{" not in route else _prefix(route) + "/{id}"


def openapi_path(path: str) -> str:
    """``path`` as OpenAPI writes it: ``{model_id:path}`` becomes ``{model_id}``."""
    return re.sub(r"{(\w+):\w+}", r"{\1}", path)
