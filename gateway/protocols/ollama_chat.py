"""Ollama's ``POST /api/chat`` and ``POST /api/generate``: thin adapters between Ollama's
JSON and the internal :class:`Conversation` and its events.

Answers stream as NDJSON (one JSON object a line; ``stream`` is true unless the request
says false): each line carries a piece of the answer (``message.content`` and
``message.thinking``, or ``response`` and ``thinking``), tool calls come whole in a line
of their own (``arguments`` as objects), and the last line has ``done: true``,
``done_reason`` and the counts and durations (:func:`gateway.protocols.ollama_run.stats`).
An error once the stream has begun is a line ``{"error": "..."}``, as Ollama sends it.

``/api/generate`` with an empty prompt loads the model (``done_reason: "load"``), or,
with ``keep_alive`` 0, lets it unload (``"unload"``), as Ollama's clients use it.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.calls import Call, Front, admit
from gateway.conversation.form import IMAGE_MARK, Comment, Conversation, FunctionTool, ImageRef, Piece, ToolCall, Turn
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, guarded, to_json
from gateway.protocols.openai_format import LogprobFormatter
from gateway.protocols.ollama_run import context_of, keep_alive, start, stats
from gateway.protocols.ollama_schemas import (ChatRequest, GenerateRequest, Message, _Generating, keep_alive_seconds,
                                              parse, served_name, timestamp)

NDJSON = "application/x-ndjson"


# ---------------------------------------------------------------------- requests
def _images(images: Optional[list[str]], where: str) -> list[ImageRef]:
    """Ollama's images (base64 strings; a ``data:`` URL is taken too)."""
    return [ImageRef(f"{where}.{k}", url=b64) if b64.startswith("data:") else ImageRef(f"{where}.{k}", data=b64)
            for k, b64 in enumerate(images or [])]


def _turn(m: Message, i: int) -> Turn:
    images = _images(m.images, f"messages.{i}.images")
    text = IMAGE_MARK * len(images) + (m.content or "").replace(IMAGE_MARK, "")
    calls = [ToolCall(c.id or f"call_{i}_{k}", c.function.name,
                      c.function.arguments if isinstance(c.function.arguments, str)
                      else json.dumps(c.function.arguments, ensure_ascii=False))
             for k, c in enumerate(m.tool_calls or [])]
    role = "system" if m.role == "developer" else m.role
    if role == "tool":
        return Turn("tool", text, tool_call_id=m.tool_call_id, name=m.tool_name, images=images)
    return Turn(role, text, m.thinking or None, calls, images=images)


def _conversation(req: _Generating, turns: list[Turn]) -> Conversation:
    opts = req.opts()
    sampling = opts.sampling()
    sampling.logprobs, sampling.top_logprobs = bool(req.logprobs), req.top_logprobs or 0
    return Conversation(turns, sampling, output_schema=req.output_schema(), output_param="format",
                        stop=opts.stops(), template_kwargs=req.template_kwargs(), model=req.model,
                        stream=req.stream is not False)


def chat_conversation(req: ChatRequest) -> Conversation:
    """An ``/api/chat`` request as the internal form: ``images`` before the text of their
    message, tool calls' ``arguments`` objects as JSON text, a ``tool`` message's
    ``tool_name`` as the name of its call.

    Raises:
        APIError: 400 for a bad ``format``, ``think`` or ``tool_choice``.
    """
    conv = _conversation(req, [_turn(m, i) for i, m in enumerate(req.messages)])
    conv.tools = [FunctionTool(t.function.name, t.function.description, t.function.parameters, f"tools.{i}.function")
                  for i, t in enumerate(req.tools or [])]
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice: a function's choice needs function.name", param="tool_choice")
        conv.tool_choice, conv.forced_tool = "function", name
    elif choice is not None:
        if choice not in ("auto", "none", "required"):
            raise APIError(400, f"invalid tool_choice: {choice!r}", param="tool_choice")
        conv.tool_choice = choice
    return conv


def generate_conversation(req: GenerateRequest) -> Conversation:
    """An ``/api/generate`` request as the internal form: ``system`` (when given), then the
    prompt as a user turn with its images."""
    images = _images(req.images, "images")
    turns = [Turn("system", req.system)] if req.system else []
    turns.append(Turn("user", IMAGE_MARK * len(images) + (req.prompt or "").replace(IMAGE_MARK, ""), images=images))
    return _conversation(req, turns)


# ---------------------------------------------------------------------- answers
def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {}


def tool_calls(calls: list[ToolCall]) -> list[dict]:
    """Ollama's ``tool_calls``: ``arguments`` as objects."""
    return [{"id": c.id, "function": {"index": k, "name": c.name, "arguments": _arguments(c.arguments)}}
            for k, c in enumerate(calls)]


def done_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _line(d: dict) -> bytes:
    return (to_json(d) + "\n").encode()


async def _answer(request: Request, call: Call, conv: Conversation, chat: bool, **how) -> Response:
    """Run ``conv`` and answer it in Ollama's shape, streamed or whole."""
    run = await start(call, conv, **how)
    model = call.model_name
    fmt: list = []  # the logprob formatter, once the model is loaded

    def logprobs(tokens) -> dict:
        """Ollama's ``logprobs`` of ``tokens`` (OpenAI's chat entries: token, logprob, bytes,
        top_logprobs), when asked for."""
        if not conv.sampling.logprobs:
            return {}
        if not fmt:
            fmt.append(LogprobFormatter(run.model.tokenizer))
        return {"logprobs": [fmt[0].chat_entry(t) for t in tokens]}

    def piece(text: str, thinking: str) -> dict:
        if chat:
            msg = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            return {"message": msg}
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def last(fin, text: str = "", thinking: str = "", calls: Optional[list[ToolCall]] = None) -> dict:
        body = {"model": model, "created_at": timestamp(), **piece(text, thinking)}
        if calls and chat:
            body["message"]["tool_calls"] = tool_calls(calls)
        body.update(done=True, done_reason=done_reason(fin.reason))
        if not chat:
            body["context"] = context_of(run)
        body.update(stats(run, fin.usage))
        return body

    if conv.stream:

        async def lines() -> AsyncIterator[bytes]:
            async for ev in run.events():
                if isinstance(ev, Comment):
                    continue
                if isinstance(ev, Piece):
                    if ev.text or ev.reasoning or (ev.tokens and conv.sampling.logprobs):
                        yield _line({"model": model, "created_at": timestamp(), **piece(ev.text, ev.reasoning),
                                     **logprobs(ev.tokens), "done": False})
                    continue
                if run.calls and chat:
                    yield _line({"model": model, "created_at": timestamp(),
                                 "message": {"role": "assistant", "content": "", "tool_calls": tool_calls(run.calls)},
                                 "done": False})
                yield _line(last(ev))

        return SSEResponse(guarded(lines(), lambda e: _line(e.ollama_body())),
                           send_timeout=call.front.config.client_timeout, media_type=NDJSON)

    result = await run.collect(request)
    if result is None:
        return Response(status_code=499)
    return JSONResponse({**last(result.finished, result.text, result.reasoning, result.tool_calls),
                         **logprobs(result.tokens)})


async def chat(request: Request) -> Response:
    """``POST /api/chat`` (see the module docstring).

    Raises:
        APIError: 400 for a bad body, 401/403, 404 for the model, 413/429/503.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "ollama_chat", "ollama")
    req = parse(ChatRequest, call.body)
    if not req.model:
        raise APIError(400, "model is required", param="model")
    req.model = served_name(front, req.model)
    conv = chat_conversation(req)
    if not req.messages:  # Ollama's idiom: load the model (or let it go, with keep_alive 0)
        return await _load_or_unload(call, req, "message", {"role": "assistant", "content": ""})
    response = await _answer(request, call, conv, chat=True)
    keep_alive(call, req.keep_alive)
    return response


async def generate(request: Request) -> Response:
    """``POST /api/generate`` (see the module docstring). ``context`` continues an earlier
    answer; ``raw`` sends the prompt as it is; ``suffix`` is refused (no model here has
    fill-in-the-middle); ``template`` (a Go template of Ollama's) is ignored: the model's
    own chat template renders the prompt.

    Raises:
        APIError: 400 for a bad body or a ``suffix``, 401/403, 404 for the model, 413/429/503.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "ollama_generate", "ollama")
    req = parse(GenerateRequest, call.body)
    if not req.model:
        raise APIError(400, "model is required", param="model")
    req.model = served_name(front, req.model)
    if req.suffix:
        raise APIError(400, f"{req.model} does not support insert (fill-in-the-middle): send no suffix",
                       param="suffix")
    if req.images and (req.raw or req.context):
        raise APIError(400, "images go with a templated prompt: send them without raw and without context",
                       param="images")
    conv = generate_conversation(req)
    if not req.prompt and not req.images and not req.context:
        return await _load_or_unload(call, req, "response", "")
    how = {"context": req.context or None, "raw": req.prompt if req.raw else None}
    response = await _answer(request, call, conv, chat=False, **how)
    keep_alive(call, req.keep_alive)
    return response


async def _load_or_unload(call: Call, req, field: str, empty) -> Response:
    """An empty request: load the model and answer ``done_reason: "load"``, or with
    ``keep_alive`` 0 let it unload once idle (``"unload"``)."""
    unload = req.keep_alive is not None and keep_alive_seconds(req.keep_alive) == 0
    if unload:
        slot = call.front.find_model(call.tenant, req.model)
        call.record.model = name = slot.name
        call.front.models.keep_for(slot, 0)
    else:
        model = await call.model(req.model)
        keep_alive(call, req.keep_alive)
        name = model.name
    return JSONResponse({"model": name, "created_at": timestamp(), field: empty,
                         "done": True, "done_reason": "unload" if unload else "load"})
