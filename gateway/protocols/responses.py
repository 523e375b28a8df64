"""OpenAI Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``
and ``GET /v1/responses/{id}/input_items`` (listed by ``responses_items.py``), a thin
adapter between the API's items and the internal :class:`Conversation` and its events.

Input items become turns: ``instructions`` is a system turn first, ``developer`` a
system turn, and a ``reasoning`` item, an assistant ``message`` and the calls after it
(``function_call``, ``custom_tool_call``, ``local_shell_call``) make one assistant turn
(consecutive calls are one turn with several calls); their outputs are tool turns; the
calls of hosted tools are left out. A ``reasoning`` item's sealed ``encrypted_content``
is opened (:mod:`gateway.protocols.reasoning_seal`), and an answer's reasoning sealed when
the request includes ``reasoning.encrypted_content``. Tools are mapped by
:mod:`gateway.protocols.responses_tools`.
``reasoning.effort`` ``none`` sets the chat template's ``enable_thinking`` to false,
any other effort to true; without it the template's default holds. ``text.format``
``json_object``/``json_schema`` constrain the output like chat's ``response_format``.

Output items are made by :class:`OutputBuilder` (:mod:`gateway.protocols.responses_events`).
``usage`` comes from the prefix cache: ``input_tokens_details.cached_tokens`` were read
from it, ``cache_write_tokens`` stored in it by this request.

With ``store`` (the default) a finished response is kept in the tenant's
:class:`ResponseStore` with its whole conversation, for ``GET`` and for
``previous_response_id`` (whose conversation then comes before the new input; the
previous ``instructions`` are not carried over), before its final event or body is sent;
one the store could not keep is answered with ``store: false``. Another tenant's ids
answer 404 exactly like unknown ones; a store that fails answers lookups with 503. Failed
or abandoned responses are not stored.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import ChatResult, Conversation, Finished, Piece, Sampling, ToolCall, Turn, Usage
from gateway.conversation.run import Run
from gateway.conversation.start import converse
from gateway.conversation.tools import offered_name, omitted_tools_header
from gateway.front import Call, Front, admit
from gateway.http.errors import APIError
from gateway.http.sse import named_event
from gateway.protocols.reasoning_seal import LazySeal
from gateway.protocols.responses_events import OutputBuilder, object_id
from gateway.protocols.responses_items import check_unique_ids, input_items, page_query, with_ids
from gateway.protocols.responses_schemas import (CustomToolCallItem, FunctionCallItem, FunctionCallOutputItem,
                                                 HostedCallItem, LocalShellCallItem, MessageItem,
                                                 ReasoningItem, ResponsesRequest, parse_items, parse_request)
from gateway.protocols.responses_store import ResponseStore, StoredResponse
from gateway.protocols.responses_tools import offered_tools, tool_choice
from gateway.protocols.respond import Format, respond
from gateway.tenancy.auth import authenticate

PARAMS = {"max_tokens": "max_output_tokens", "messages": "input"}


def not_found(rid: str, param: Optional[str] = None) -> APIError:
    """The 404 for a response id that is missing, deleted, evicted or another tenant's."""
    return APIError(404, f"no response with id '{rid}' found", param=param, code="not_found")


# ---------------------------------------------------------------------- request
def to_turns(items: list, opened: Callable[[ReasoningItem], Optional[str]] = lambda it: None) -> list[Turn]:
    """Input items as turns (see the module docstring for how assistant items merge).
    ``opened``: the reasoning a ``reasoning`` item's ``encrypted_content`` seals (None when
    it has none this gateway can open; its content or summary is taken then)."""
    turns: list[Turn] = []
    cur: Optional[Turn] = None  # the assistant turn being built

    def assistant() -> Turn:
        nonlocal cur
        if cur is None:
            cur = Turn("assistant")
            turns.append(cur)
        return cur

    for k, it in enumerate(items):
        if isinstance(it, ReasoningItem):
            if cur is None or cur.text or cur.tool_calls or cur.reasoning is not None:
                cur = None
            sealed = opened(it) if it.encrypted_content else None
            assistant().reasoning = sealed if sealed is not None else it.text()
        elif isinstance(it, FunctionCallItem):
            assistant().tool_calls.append(ToolCall(it.call_id, it.name, it.arguments, namespace=it.namespace))
        elif isinstance(it, CustomToolCallItem):
            assistant().tool_calls.append(ToolCall(it.call_id, it.name, it.input, kind="custom"))
        elif isinstance(it, LocalShellCallItem):
            action = {k: v for k, v in it.action.items() if k != "type"}
            assistant().tool_calls.append(ToolCall(it.call_id, "local_shell", json.dumps(action, ensure_ascii=False)))
        elif isinstance(it, HostedCallItem):
            continue  # a hosted tool's call: nothing the model can be shown
        elif isinstance(it, MessageItem) and it.role == "assistant":
            if cur is None or cur.text or cur.tool_calls:
                cur = None
            assistant().text = it.text()
        elif isinstance(it, FunctionCallOutputItem):
            cur = None
            text, images = it.text_and_images(f"input.{k}")
            turns.append(Turn("tool", text, tool_call_id=it.of, images=images))
        else:
            cur = None
            text, images = it.text_and_images(f"input.{k}")
            turns.append(Turn("system" if it.role == "developer" else it.role, text, images=images))
    return turns


def to_conversation(req: ResponsesRequest, items: list,
                    opened: Callable[[ReasoningItem], Optional[str]] = lambda it: None
                    ) -> tuple[Conversation, list[str]]:
    """The request as the internal form, and the hosted tools left out of it; ``items`` is
    the whole input (a previous response's conversation first).

    Raises:
        APIError: 400 for a ``json_schema`` format without a schema, or a ``tool_choice``
            that forces a hosted tool.
    """
    turns = ([Turn("system", req.instructions)] if req.instructions is not None else []) + to_turns(items, opened)
    tools, omitted = offered_tools(req.tools or [])
    choice, forced, allowed = tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    schema, param = None, "text.format.schema"
    if fmt is not None and fmt.type == "json_object":
        schema, param = {"type": "object"}, "text.format"
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        schema = fmt.schema_
    kwargs = {}
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs["enable_thinking"] = req.reasoning.effort != "none"
    sampling = Sampling(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                        top_k=req.top_k, min_p=req.min_p, seed=req.seed, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                        logit_bias=req.logit_bias, ignore_eos=req.ignore_eos)
    strict = fmt is not None and fmt.type == "json_schema" and getattr(fmt, "strict", None) is True
    conv = Conversation(turns, sampling, tools, choice, forced, req.parallel_tool_calls is not False, schema,
                        param, strict, template_kwargs=kwargs, model=req.model, stream=bool(req.stream),
                        allowed_tools=allowed)
    return conv, omitted


def dump_items(items: list) -> list[dict]:
    """Parsed input items as the JSON dicts the store keeps."""
    return [it.model_dump(mode="json", by_alias=True, exclude_none=True) for it in items]


# ---------------------------------------------------------------------- response
def usage(u: Usage) -> dict:
    """The Responses API's ``usage`` (``input_tokens`` include the cached ones)."""
    return {"input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": u.cache_written},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": u.reasoning},
            "total_tokens": u.prompt + u.completion}


def base_response(call, req: ResponsesRequest, rid: str) -> dict:
    """The response object as it starts (``in_progress``, no output), echoing the request
    (the held model's defaults where it gives no sampling setting)."""
    choice = req.tool_choice or "auto"
    spec = call.slot.spec
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "model": call.model_name, "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
        "store": req.store, "temperature": req.temperature if req.temperature is not None else spec.temp,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text is not None and req.text.format is not None else {"type": "text"})},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(exclude_none=True),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": req.top_p if req.top_p is not None else spec.top_p, "truncation": "disabled",
        "usage": None, "user": req.user, "metadata": dict(req.metadata or {}),
    }


def final_response(base: dict, out: OutputBuilder, finished: Finished) -> dict:
    """The finished response object: ``completed``, or ``incomplete`` when cut by length."""
    cut = finished.reason == "length"
    return {**base, "status": "incomplete" if cut else "completed", "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "output": out.items,
            "usage": usage(finished.usage)}


def failed_response(base: dict, out: OutputBuilder, error: APIError) -> dict:
    """The response object of a generation that failed after the stream began."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {**base, "status": "failed", "output": out.items, "error": {"code": code, "message": error.message}}


# ---------------------------------------------------------------------- routes
def _encode(ev: dict) -> bytes:
    return named_event(ev["type"], ev)


class ResponseFormat(Format):
    """A response object, or its stream of events (:class:`gateway.protocols.respond.Format`),
    stored before its final event or body is sent (``store``)."""

    def __init__(self, req: ResponsesRequest, call: Call, out: OutputBuilder, store: ResponseStore,
                 conversation: list[dict], headers: Optional[dict]):
        self.req, self.stream, self.call, self.out, self.headers = req, bool(req.stream), call, out, headers
        self.store, self.conversation = store, conversation
        self.rid, self.base = object_id("resp"), None

    def opening(self) -> bytes:
        self.base = base_response(self.call, self.req, self.rid)
        return b"".join(_encode(self.out.event(kind, response=self.base))
                        for kind in ("response.created", "response.in_progress"))

    def piece(self, run: Run, piece: Piece) -> bytes:
        return b"".join(map(_encode, self.out.feed(piece)))

    async def finish(self, run: Run, ev: Finished) -> bytes:
        evs = self.out.finish(ev)
        response = await self._keep(final_response(self.base, self.out, ev))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return b"".join(map(_encode, evs + [self.out.event(kind, response=response)]))

    def error(self, e: APIError) -> bytes:
        return _encode(self.out.event("response.failed", response=failed_response(self.base, self.out, e)))

    async def whole(self, run: Run, result: ChatResult) -> dict:
        self.base = base_response(self.call, self.req, self.rid)
        for piece in result.pieces:
            self.out.feed(piece)
        self.out.finish(result.finished)
        return await self._keep(final_response(self.base, self.out, result.finished))

    async def _keep(self, response: dict) -> dict:
        """``response``, stored first (with ``store: false`` when it could not be)."""
        if self.req.store and not await self.store.put(self.call.tenant.name, response,
                                                       self.conversation + response["output"]):
            response = {**response, "store": False}
        return response


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: a response object, or its stream of events.

    Raises:
        APIError: 400 for a bad body (dotted parameter path) or an input item whose id
            its conversation already has, 401, 404 for an unknown ``previous_response_id``
            or model, 403, 413/429/503 when it cannot be queued, 503 when the response
            store failed to look up ``previous_response_id``.
    """
    store: ResponseStore = request.app.state.responses
    call = await admit(request.app.state.front, request, "responses", "responses")
    req, items = parse_request(call.body)
    tenant = call.tenant.name
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = await store.get(tenant, req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.items
    new_items = with_ids(dump_items(items))
    check_unique_ids(history, new_items)
    seal: LazySeal = request.app.state.reasoning_seal
    conv, omitted = to_conversation(req, parse_items(history, "previous_response_id") + items,
                                    lambda it: seal.open(it.encrypted_content, tenant))
    sealed = "reasoning.encrypted_content" in (req.include or [])
    out = OutputBuilder({offered_name(t): t for t in conv.tools},
                        (lambda text: seal.seal(text, tenant)) if sealed else None)
    form = ResponseFormat(req, call, out, store, history + new_items, omitted_tools_header(omitted))
    try:
        return await respond(request, converse(call, conv), form)
    except APIError as e:
        e.param = PARAMS.get(e.param, e.param)  # the shared code names chat's parameters
        raise


async def _stored(request: Request) -> StoredResponse:
    """The caller's stored response named by the path.

    Raises:
        APIError: 401; 404 for an id that is unknown, deleted, evicted or another tenant's;
            503 when the store failed.
    """
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    rid = request.path_params["response_id"]
    entry = await request.app.state.responses.get(tenant.name, rid)
    if entry is None:
        raise not_found(rid)
    return entry


async def retrieve_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: the stored response object.

    Raises:
        APIError: 401; 404 for an id that is unknown, deleted, evicted or another tenant's;
            503 when the store failed.
    """
    return JSONResponse((await _stored(request)).response)


async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{response_id}/input_items``: a page of the stored response's
    input items (query ``after``, ``limit``, ``order``; ``responses_items.py``).

    Raises:
        APIError: 400 for a bad query parameter (or an ``after`` not in the list); 401;
            404 for a response id that is unknown, deleted, evicted or another tenant's;
            503 when the store failed.
    """
    query = page_query(request.query_params)
    return JSONResponse(input_items(await _stored(request), *query))


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: ``{"id", "object": "response", "deleted": true}``.

    Raises:
        APIError: 401; 404 for an id that is unknown, already deleted, evicted or another tenant's;
            503 when the store failed.
    """
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    rid = request.path_params["response_id"]
    if not await request.app.state.responses.delete(tenant.name, rid):
        raise not_found(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})
