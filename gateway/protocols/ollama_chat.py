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
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import (IMAGE_MARK, ChatResult, Conversation, Finished, FunctionTool, ImageRef, Piece,
                                       ToolCall, Turn)
from gateway.conversation.start import converse, find, hold, ready
from gateway.front import Call, Front, admit
from gateway.http.errors import APIError
from gateway.http.sse import to_json
from gateway.protocols.openai_format import LogprobFormatter
from gateway.protocols.ollama_run import context_of, keep_alive, stats
from gateway.protocols.respond import Format, respond
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
    return Conversation(turns, sampling, output_schema=req.output_schema(), output_param="format", stop=opts.stops(),
                        template_kwargs=req.template_kwargs(), model=req.model, stream=req.stream is not False)


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


class OllamaFormat(Format):
    """Ollama's answer to ``/api/chat`` (``chat``) or ``/api/generate``: NDJSON lines, or
    one JSON body; comments (progress, keep-alive) are not sent."""

    media_type = NDJSON

    def __init__(self, call: Call, conv: Conversation, chat: bool):
        self.call, self.conv, self.chat, self.stream = call, conv, chat, conv.stream
        self.fmt: Optional[LogprobFormatter] = None  # once the model is loaded
        self.tokens: list = []  # the answer's token events so far (generate's context)

    def comment(self, text: str) -> bytes:
        return b""

    def error(self, e: APIError) -> bytes:
        return _line(e.ollama_body())

    def _logprobs(self, run, tokens) -> dict:
        """Ollama's ``logprobs`` of ``tokens`` (OpenAI's chat entries: token, logprob, bytes,
        top_logprobs), when asked for."""
        if not self.conv.sampling.logprobs:
            return {}
        if self.fmt is None:
            self.fmt = LogprobFormatter(run.model.tokenizer)
        return {"logprobs": [self.fmt.chat_entry(t) for t in tokens]}

    def _piece(self, text: str, thinking: str) -> dict:
        if self.chat:
            msg = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            return {"message": msg}
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def _last(self, run, fin, text: str = "", thinking: str = "", calls: Optional[list[ToolCall]] = None) -> dict:
        body = {"model": self.call.model_name, "created_at": timestamp(), **self._piece(text, thinking)}
        if calls and self.chat:
            body["message"]["tool_calls"] = tool_calls(calls)
        body.update(done=True, done_reason=done_reason(fin.reason))
        if not self.chat:
            body["context"] = context_of(run, self.tokens)
        body.update(stats(run, fin.usage))
        return body

    def piece(self, run, piece: Piece) -> bytes:
        self.tokens.extend(piece.tokens)
        if piece.text or piece.reasoning or (piece.tokens and self.conv.sampling.logprobs):
            return _line({"model": self.call.model_name, "created_at": timestamp(),
                          **self._piece(piece.text, piece.reasoning), **self._logprobs(run, piece.tokens),
                          "done": False})
        return b""

    async def finish(self, run, ev: Finished) -> bytes:
        out = b""
        if run.calls and self.chat:
            out = _line({"model": self.call.model_name, "created_at": timestamp(),
                         "message": {"role": "assistant", "content": "", "tool_calls": tool_calls(run.calls)},
                         "done": False})
        return out + _line(self._last(run, ev))

    async def whole(self, run, result: ChatResult) -> dict:
        self.tokens = result.tokens
        return {**self._last(run, result.finished, result.text, result.reasoning, result.tool_calls),
                **self._logprobs(run, result.tokens)}


async def _admitted(request: Request, endpoint: str, body: type) -> tuple[Call, _Generating]:
    """Admit a generating request and parse its ``body``, its model named as served.

    Raises:
        APIError: 400 for a bad body or no ``model``, 401/403, 413/429.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, endpoint, "ollama")
    req = parse(body, call.body)
    if not req.model:
        raise APIError(400, "model is required", param="model")
    req.model = served_name(front, req.model)
    return call, req


async def chat(request: Request) -> Response:
    """``POST /api/chat`` (see the module docstring).

    Raises:
        APIError: 400 for a bad body, 401/403, 404 for the model, 413/429/503.
    """
    call, req = await _admitted(request, "ollama_chat", ChatRequest)
    conv = chat_conversation(req)
    if not req.messages:  # Ollama's idiom: load the model (or let it go, with keep_alive 0)
        return await _load_or_unload(call, req, "message", {"role": "assistant", "content": ""})
    response = await respond(request, converse(call, conv), OllamaFormat(call, conv, chat=True))
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
    call, req = await _admitted(request, "ollama_generate", GenerateRequest)
    if req.suffix:
        raise APIError(400, f"{req.model} does not support insert (fill-in-the-middle): send no suffix",
                       param="suffix")
    if req.images and (req.raw or req.context):
        raise APIError(400, "images go with a templated prompt: send them without raw and without context",
                       param="images")
    conv = generate_conversation(req)
    if not req.prompt and not req.images and not req.context:
        return await _load_or_unload(call, req, "response", "")
    conv.context = req.context or None
    if req.raw:
        conv.raw = req.prompt or ""
    response = await respond(request, converse(call, conv), OllamaFormat(call, conv, chat=False))
    keep_alive(call, req.keep_alive)
    return response


async def _load_or_unload(call: Call, req, field: str, empty) -> Response:
    """An empty request: load the model and answer ``done_reason: "load"``, or with
    ``keep_alive`` 0 let it unload once idle (``"unload"``)."""
    unload = req.keep_alive is not None and keep_alive_seconds(req.keep_alive) == 0
    if unload:
        slot = find(call, req.model)
        call.record.model = name = slot.name
        call.front.models.keep_for(slot, 0)
    else:
        model = await ready(hold(call, req.model))
        keep_alive(call, req.keep_alive)
        name = model.name
    return JSONResponse({"model": name, "created_at": timestamp(), field: empty,
                         "done": True, "done_reason": "unload" if unload else "load"})
